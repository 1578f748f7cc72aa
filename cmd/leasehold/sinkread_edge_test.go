package main

import (
	"strings"
	"testing"
)

// A KV sink's bucket holds what anyone allowed to write it put there, and
// a stamp's worker is free text that a NATS header carries byte for byte,
// escape sequences included. `sink get` and `sink ls` print to an
// operator's terminal: a forged worker must not reach it raw.
func TestSinkReadForgedStamp(t *testing.T) {
	t.Parallel()
	s, ctx, _ := kvSinkHolding(t, "k1", "w1\x1b]0;owned\x07\x1b[2J")
	for _, args := range [][]string{{"sink", "get", "k1"}, {"sink", "ls"}} {
		out, err := run(t, ctx, append(args, "--nats", s.URL())...)
		if err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
		if strings.ContainsAny(out, "\x1b\x07") {
			t.Errorf("%s prints a forged worker's escape sequences raw:\n%q", strings.Join(args, " "), out)
		}
	}
}
