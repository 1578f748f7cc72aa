package main

import (
	"strings"
	"testing"
	"time"
)

// `jobs show` reads a job's progress from the lease bucket: a --bucket of
// another job stream answers with that stream's progress, which says
// nothing about this one's jobs. As status does, jobs refuses a bucket
// that serves another prefix.
func TestJobsWithAnotherStreamsBucket(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 60*time.Second)
	for _, prefix := range []string{"a", "b"} {
		if out, err := run(t, ctx, "init", "--nats", s.URL(), "--prefix", prefix, "--partitions", "2"); err != nil {
			t.Fatalf("init --prefix %s: %v\n%s", prefix, err, out)
		}
	}
	out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "--prefix", "a", "--refs")
	if err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	ref := strings.Fields(out)[0]
	out, err = run(t, ctx, "jobs", "show", "--nats", s.URL(), "--prefix", "a", "--bucket", "b-leases", ref)
	if err == nil || !strings.Contains(err.Error(), "serves the job stream of prefix") {
		t.Errorf("jobs show %s --prefix a --bucket b-leases: %v\n%s", ref, err, out)
	}
}
