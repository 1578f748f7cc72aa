package main

import (
	"strings"
	"testing"
	"time"
)

// enqueue --unique stores a job once per kind and payload (or per
// --unique-key) for the period, and names the job stored first.
func TestEnqueueUnique(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, 60*time.Second, "--partitions", "2")
	args := []string{"enqueue", "--nats", s.URL(), "--kind", "email", "--unique", "24h", "--refs", `{"to":"ann"}`}
	out, err := run(t, ctx, args...)
	if err != nil || !strings.Contains(out, "enqueued 1 jobs") {
		t.Fatalf("first enqueue: %v\n%s", err, out)
	}
	ref := strings.SplitN(out, "\n", 2)[0]
	out, err = run(t, ctx, args...)
	if err != nil || !strings.Contains(out, "enqueued 0 jobs") || !strings.Contains(out, "enqueued already as "+ref) {
		t.Fatalf("a copy: %v\n%s", err, out)
	}
	key := []string{"enqueue", "--nats", s.URL(), "--unique", "1h", "--unique-key", "nightly"}
	mustRun(t, ctx, append(key, "a")...)
	if out, err := run(t, ctx, append(key, "b")...); err != nil || !strings.Contains(out, "enqueued 0 jobs") {
		t.Fatalf("a copy by key: %v\n%s", err, out)
	}
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "--unique-key", "k"); err == nil {
		t.Fatalf("--unique-key without --unique: no error\n%s", out)
	}
}
