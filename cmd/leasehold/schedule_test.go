package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// schedule apply declares the periodic jobs of a YAML file once however
// often it is applied; the server fires them onto a job subject; schedule
// rm removes one.
func TestScheduleApplyAndRemove(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 90*time.Second)
	base := []string{"--nats", s.URL(), "--prefix", "sq"}
	cli := func(args ...string) []string { return append(args, base...) }
	file := filepath.Join(t.TempDir(), "periodic.yaml")
	if err := os.WriteFile(file, []byte("periodic:\n  - name: tick\n    kind: tick\n    every: 1s\n    payload: {n: 1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	mustRun(t, ctx, cli("init", "--partitions", "2")...)
	if _, err := run(t, ctx, cli("schedule", "apply", file)...); err == nil || !strings.Contains(err.Error(), "--schedules") {
		t.Fatalf("schedule apply on a job stream without schedules: %v, want an error that says how to turn them on", err)
	}
	mustRun(t, ctx, cli("init", "--schedules")...)
	for range 2 {
		out := mustRun(t, ctx, cli("schedule", "apply", file)...)
		wantIn(t, "schedule apply", out, "periodic job tick: kind tick, every 1s", "1 periodic jobs declared")
	}

	js := s.JetStream(t)
	st, err := js.Stream(ctx, worker.JobsStream("sq"))
	if err != nil {
		t.Fatal(err)
	}
	subject := worker.PeriodicSubject("sq", "tick")
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatal(err)
	}
	if n := info.State.Subjects[subject]; n != 1 {
		t.Fatalf("%d schedules stored on %s after applying the file twice, want 1", n, subject)
	}
	// The server fires a tick onto a job subject, naming the schedule.
	fired := func() bool {
		for p := range 2 {
			m, err := st.GetLastMsgForSubject(ctx, worker.JobSubject("sq", leasehold.Partition(p)))
			if err == nil && m.Header.Get("Nats-Scheduler") == subject {
				return true
			}
		}
		return false
	}
	for !fired() {
		select {
		case <-ctx.Done():
			t.Fatal("no tick fired onto a job subject")
		case <-time.After(100 * time.Millisecond):
		}
	}

	mustRun(t, ctx, cli("schedule", "rm", "tick")...)
	if _, err := st.GetLastMsgForSubject(ctx, subject); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Fatalf("the schedule after schedule rm: %v, want it gone", err)
	}
	if _, err := run(t, ctx, cli("schedule", "apply", filepath.Join(t.TempDir(), "missing.yaml"))...); err == nil {
		t.Error("schedule apply of a missing file succeeded")
	}
}
