package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A job whose handler panicked is one line in `dlq list`, its error
// saying where; `dlq show` prints the panic's stack whole, once.
func TestDlqPanicIsOneLineAndShowPrintsTheStack(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, 60*time.Second, "--prefix", "pq", "--partitions", "1")
	js := s.JetStream(t)
	prog := runDLQWorker(t, ctx, js, "pq", 1, func(ctx context.Context, j *worker.Job) error {
		panic("card declined\nby the bank")
	})
	enqueueDone(t, ctx, js, "pq", 1, prog, []byte(`{"order":1}`), worker.JobID("order-1"))

	conn := []string{"--nats", s.URL(), "--prefix", "pq"}
	out := mustRun(t, ctx, append([]string{"dlq", "list"}, conn...)...)
	t.Logf("dlq list:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 || !strings.Contains(lines[1], "order-1") ||
		!strings.Contains(lines[1], "panic: card declined | by the bank at leasehold/dlqpanic_test.go:") || strings.Contains(out, "goroutine") {
		t.Errorf("dlq list: want one row, the panic on one line with where it was raised:\n%s", out)
	}
	out = mustRun(t, ctx, append([]string{"dlq", "show", "1"}, conn...)...)
	t.Logf("dlq show 1:\n%s", out)
	wantIn(t, "show", out, "Leasehold-Error: panic: card declined | by the bank at leasehold/dlqpanic_test.go:",
		"Leasehold-Stack: (the stack of the handler's panic, below)", "stack of the handler's panic:\n  goroutine ", "leasehold/dlqpanic_test.go:")
	if n := strings.Count(out, " [running]:"); n != 1 {
		t.Errorf("dlq show prints the stack %d times, want once", n)
	}
}
