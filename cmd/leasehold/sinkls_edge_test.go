package main

import (
	"strings"
	"testing"

	"github.com/leasehold/leasehold/sink/kvsink"
)

// One value without a stamp (a `nats kv put` by hand) must not hide every
// other value from `sink ls`: the listing is how an operator finds it.
func TestSinkLsWithAnUnstampedValue(t *testing.T) {
	t.Parallel()
	s, ctx, js := kvSinkHolding(t, "good", "w1")
	if _, err := js.Publish(ctx, "$KV."+kvsink.DefaultBucket+".bare", []byte("by hand")); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, ctx, "sink", "ls", "--nats", s.URL())
	if err != nil || !strings.Contains(out, "good") || !strings.Contains(out, "key bare: ") {
		t.Errorf("sink ls with one unstamped value: %v\n%s", err, out)
	}
	out, err = run(t, ctx, "sink", "ls", "--json", "--nats", s.URL())
	if err != nil || !strings.Contains(out, `"key": "good"`) || !strings.Contains(out, `"unreadable"`) {
		t.Errorf("sink ls --json with one unstamped value: %v\n%s", err, out)
	}
}
