package main

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A job whose handler panicked is one line in `dlq list`, its error
// saying where; `dlq show` prints the panic's stack whole, once.
func TestDlqPanicIsOneLineAndShowPrintsTheStack(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	mustRun(t, ctx, "init", "--nats", s.URL(), "--prefix", "pq", "--partitions", "1")
	js := s.JetStream(t)
	bucket, err := coordinator.OpenBucket(ctx, js, "pq-leases")
	if err != nil {
		t.Fatal(err)
	}
	prog := newProgress()
	w, err := worker.New(worker.Config{
		JetStream: js, Prefix: "pq", Partitions: 1, Bucket: bucket, MaxAttempts: 1,
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			panic("card declined\nby the bank")
		}),
		Coordinator: coordinator.Config{Worker: "w", TTL: 2 * time.Second},
		Observer:    prog,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(wctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-stopped; err != nil {
			t.Errorf("worker: %v", err)
		}
	})
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "pq", Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	e, err := p.EnqueueTo(ctx, 0, []byte(`{"order":1}`), worker.JobID("order-1"))
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 0, e.Seq)

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
