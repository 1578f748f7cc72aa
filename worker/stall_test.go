package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A large backlog drains without a pull request ever expiring while jobs
// wait. nats.go's Consume can stall a consumer with a backlog (a refill
// that falls due while a pull is being sent is skipped); the worker's Fetch
// loop must not, and counts any pull that ends early as a stall.
func TestBacklogDrainsWithoutStalls(t *testing.T) {
	const n, total = 2, 20000
	e := newEnv(t, n)
	e.enqueue(t, 0, total)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.FetchBatch = 20 // small batches: many refills, where the stall hid
	cfg.Observer = rec
	r := start(t, cfg)
	rec.waitFor(t, 2*time.Minute, "the backlog to drain", func() bool {
		return rec.count(kind(worker.EventJobFinished)) >= total
	})
	if s := worker.Stalls(r.w); s != 0 {
		t.Fatalf("%d pull requests expired while jobs waited", s)
	}
}
