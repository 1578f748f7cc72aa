package worker

import (
	"encoding/hex"
	"testing"
)

// An attempt's nonce is 8 bytes of a strong generator, hex-encoded: no two
// alike, and one allocation each (its string).
func TestRunnerNonces(t *testing.T) {
	n := newNonces()
	seen := map[string]bool{}
	for range 10000 {
		s := n.next()
		if b, err := hex.DecodeString(s); err != nil || len(b) != 8 {
			t.Fatalf("nonce %q is not 8 bytes in hex", s)
		}
		if seen[s] {
			t.Fatalf("nonce %q drawn twice", s)
		}
		seen[s] = true
	}
	if m := newNonces(); m.next() == n.next() {
		t.Error("two runners draw the same nonce")
	}
	if a := testing.AllocsPerRun(1000, func() { _ = n.next() }); a != 1 {
		t.Errorf("a nonce made %v allocations, want 1", a)
	}
}
