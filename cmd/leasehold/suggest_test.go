package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// Misspelt commands, subcommands and flags are answered with the names
// spelt like them.
func TestSuggestionsForUnknownCommandsAndFlags(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"statsu"}, "\tstatus"},
		{[]string{"sink", "lss"}, "\tls"},
		{[]string{"dlq", "lsit"}, "\tlist"},
		{[]string{"status", "--prefx", "x"}, "\t--prefix"},
		{[]string{"worker", "--partitons=4"}, "\t--partitions"},
		{[]string{"sink", "get", "k", "--kv-buckt", "b"}, "\t--kv-bucket"},
	} {
		_, err := run(t, ctx, c.args...)
		if err == nil || !strings.Contains(err.Error(), "Did you mean this?") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v; want a suggestion of %q", c.args, err, strings.TrimSpace(c.want))
		}
	}
	// Nothing near: no suggestion, but where to look.
	if _, err := run(t, ctx, "status", "--zzzzzz"); err == nil || strings.Contains(err.Error(), "Did you mean") || !strings.Contains(err.Error(), "leasehold status --help") {
		t.Errorf("status --zzzzzz: %v", err)
	}
}
