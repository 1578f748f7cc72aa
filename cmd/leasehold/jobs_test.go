package main

import (
	"strings"
	"testing"
	"time"
)

// enqueue prints references and reports duplicates; jobs show tells where
// the jobs are and jobs wait returns once a worker has done them.
func TestJobsShowAndWait(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 90*time.Second)
	base := []string{"--nats", s.URL(), "--prefix", "jq"}
	cli := func(args ...string) []string { return append(args, base...) }
	mustRun(t, ctx, cli("init", "--partitions", "2", "--schedules")...)

	out := mustRun(t, ctx, cli("enqueue", "--partitions", "2", "-n", "3", "--refs")...)
	var refs []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.Contains(line, ":") && !strings.Contains(line, " ") {
			refs = append(refs, line)
		}
	}
	if len(refs) != 3 {
		t.Fatalf("enqueue --refs printed %d references:\n%s", len(refs), out)
	}
	out = mustRun(t, ctx, cli("enqueue", "--partitions", "2", "--id", "order-1", "--refs")...)
	refs = append(refs, strings.Split(out, "\n")[0])
	out = mustRun(t, ctx, cli("enqueue", "--partitions", "2", "--id", "order-1")...)
	wantIn(t, "enqueue of a duplicate", out, "job order-1 is a duplicate", "at "+refs[3], "enqueued 0 jobs")
	out = mustRun(t, ctx, cli("enqueue", "--partitions", "2", "--in", "1s", "--id", "later", "--refs")...)
	delayed := strings.Split(out, "\n")[0]
	if !strings.Contains(delayed, "/later") {
		t.Fatalf("a delayed job's reference %q lacks its ID", delayed)
	}
	refs = append(refs, delayed)

	out = mustRun(t, ctx, cli(append([]string{"jobs", "show"}, refs...)...)...)
	t.Logf("jobs show before any worker:\n%s", out)
	wantIn(t, "jobs show", out, "pending")

	background(t, cli("worker", "--partitions", "2", "--worker-id", "w1", "--ttl", "2s", "--http", "", "--log-level", "error")...)
	out = mustRun(t, ctx, cli(append([]string{"jobs", "wait", "--timeout", "60s"}, refs...)...)...)
	t.Logf("jobs wait:\n%s", out)
	if n := strings.Count(out, " done "); n != len(refs) {
		t.Errorf("jobs wait: %d of %d done:\n%s", n, len(refs), out)
	}
	if _, err := run(t, ctx, cli("jobs", "show", "9:1")...); err == nil || !strings.Contains(err.Error(), "no such partition") {
		t.Errorf("jobs show of partition 9 on a 2-partition stream: %v", err)
	}
}
