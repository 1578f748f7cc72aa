package main

import (
	"strings"
	"testing"
	"time"
)

// jobs cancel skips a waiting job, which jobs show and jobs wait then call
// cancelled; a cancel of a finished job says so and fails.
func TestJobsCancel(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 90*time.Second)
	base := []string{"--nats", s.URL(), "--prefix", "jc"}
	cli := func(args ...string) []string { return append(args, base...) }
	mustRun(t, ctx, cli("init", "--partitions", "2")...)
	out := mustRun(t, ctx, cli("enqueue", "--partitions", "2", "--key", "k", "-n", "2", "--refs")...)
	refs := strings.Split(strings.TrimSpace(out), "\n")[:2]
	out = mustRun(t, ctx, cli("jobs", "cancel", refs[1])...)
	wantIn(t, "jobs cancel", out, "cancel stored")
	out = mustRun(t, ctx, cli("jobs", "show", refs[1])...)
	wantIn(t, "jobs show of a cancel not carried out", out, "pending", "a cancel was requested")

	background(t, cli("worker", "--partitions", "2", "--worker-id", "w1", "--ttl", "2s", "--http", "", "--log-level", "error")...)
	out, err := run(t, ctx, cli("jobs", "wait", "--timeout", "60s", refs[0], refs[1])...)
	if !strings.Contains(out, " done ") || !strings.Contains(out, " cancelled ") || err == nil || !strings.Contains(err.Error(), "1 cancelled") {
		t.Fatalf("jobs wait: %v\n%s", err, out)
	}
	out = mustRun(t, ctx, cli("jobs", "show", refs[1])...)
	wantIn(t, "jobs show", out, "cancelled", "skipped it under epoch")
	out, err = run(t, ctx, cli("jobs", "cancel", refs[0])...)
	if err == nil || !strings.Contains(out, "has finished (done): not cancelled") {
		t.Fatalf("cancel of a done job: %v\n%s", err, out)
	}
}
