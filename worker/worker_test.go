package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// One worker, a few partitions: every job runs once, in order, and emits
// one stamped effect.
func TestWorkerHandlesEveryJobInOrder(t *testing.T) {
	e := newEnv(t, 4)
	var runs runLog
	rec := newRecorder()
	cfg := e.config("w1", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	cfg.Order = worker.OrderPartition // the runs' order is asserted
	start(t, cfg)
	enq := e.enqueue(t, 0, 500)
	rec.waitFor(t, 30*time.Second, "500 jobs", func() bool { return runs.n.Load() >= 500 })
	last := map[uint32]uint64{}
	for _, h := range runs.all() {
		if h.Seq <= last[uint32(h.P)] {
			t.Fatalf("partition %d: job %d ran after %d", h.P, h.Seq, last[uint32(h.P)])
		}
		last[uint32(h.P)] = h.Seq
	}
	if len(runs.all()) != len(enq) {
		t.Fatalf("ran %d jobs for %d enqueued", len(runs.all()), len(enq))
	}
	rec.waitFor(t, 30*time.Second, "effects", func() bool {
		return len(readStream(t, e.js, worker.EffectsStream(e.prefix))) >= 500+4
	})
}
