package worker_test

import (
	"bytes"
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// jobGoroutines counts the goroutines that run jobs, or wait for the next
// job of their partition.
func jobGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if bytes.Contains(g, []byte("worker.(*runner).runJobs(")) {
			count++
		}
	}
	return count
}

// A job's goroutine waits for the partition's next job once its own ended,
// and must end with its lease: a partition fenced away while its
// goroutines wait, a handler found hung whose goroutine comes back after
// its partition was released, and a worker that stops leave none behind,
// however many jobs ran at once.
func TestAttackRoundJobGoroutinesEndWithTheirLease(t *testing.T) {
	// Those of earlier tests' workers (a handler that never returns
	// keeps its own) are not this test's.
	before := jobGoroutines()
	e := newEnv(t, 1)
	rec := newRecorder()
	release := make(chan struct{})
	var hung atomic.Bool
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if string(j.Data) == "key-40" && hung.CompareAndSwap(false, true) {
			<-release // past its context's end: found hung
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	cfg.PartitionConcurrency = 4
	cfg.HandleTimeout = 500 * time.Millisecond
	cfg.HangGrace = 200 * time.Millisecond
	r := start(t, cfg)

	enq := e.enqueue(t, 0, 40)
	rec.waitCommitted(t, time.Minute, enq[len(enq)-1].Seq)
	// The test sees the goroutines it counts: those of the jobs that ran
	// wait for the next.
	if n := jobGoroutines(); n <= before {
		t.Fatal("no job goroutine waits after the jobs ran: the count looks for the wrong name")
	}

	// Fenced away while its goroutines wait: the next lease's runner has
	// run no job, and the old one's goroutines are gone.
	op, err := coordinator.New(e.bucket, coordinator.Config{Worker: "operator", TTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, time.Minute)
	if _, err := op.Fence(ctx, 0); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, time.Minute, "the partition lost and acquired again", func() bool {
		return rec.count(kind(worker.EventPartitionLost)) >= 1 && rec.count(kind(worker.EventPartitionReady)) >= 2
	})
	rec.waitFor(t, time.Minute, "the fenced lease's job goroutines to end", func() bool { return jobGoroutines() <= before })

	// A hung handler: its partition is released while it runs, and its
	// goroutine comes back after.
	more := e.enqueue(t, 40, 3)
	rec.waitFor(t, time.Minute, "a handler found hung", func() bool { return rec.count(kind(worker.EventJobHung)) >= 1 })
	close(release)
	rec.waitCommitted(t, time.Minute, more[len(more)-1].Seq)

	r.stop(t)
	rec.waitFor(t, time.Minute, "every job goroutine to end with the worker", func() bool { return jobGoroutines() <= before })
}
