package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A partition that has done every job it read commits at once, not at the
// next CommitEvery: with CommitEvery an hour, the progress past a burst's
// last job is committed while the worker runs, and Wait sees the jobs done.
func TestCaughtUpPartitionCommitsAtOnce(t *testing.T) {
	e := newEnv(t, 2)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Emit(ctx, j.Data)
	}))
	cfg.CommitEvery = time.Hour
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 20)
	last := map[int]uint64{}
	for _, q := range enq {
		last[int(q.Partition)] = max(last[int(q.Partition)], q.Seq)
	}
	rec.waitFor(t, 30*time.Second, "progress past each partition's last job", func() bool {
		for p, seq := range last {
			if rec.count(func(ev worker.Event) bool {
				return ev.Kind == worker.EventProgressCommitted && int(ev.Lease.Partition) == p && ev.Seq == seq
			}) == 0 {
				return false
			}
		}
		return true
	})
	p := e.statusProducer(t)
	sts, err := p.Wait(ctxFor(t, 30*time.Second), enq...)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range sts {
		if st.State != worker.JobDone {
			t.Fatalf("job %s is %s, want done", st.Ref, st.State)
		}
	}
}

// Wait locates many jobs side by side (TestWaitForManyJobs follows them
// to their ends): a reference among them to another partition's message
// still fails it.
func TestWaitLocatesManyJobsStrictly(t *testing.T) {
	e := newEnv(t, 2)
	start(t, e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Emit(ctx, j.Data)
	})))
	enq := e.enqueue(t, 0, 100)
	p := e.statusProducer(t)
	ctx := ctxFor(t, 60*time.Second)
	sts, err := p.Wait(ctx, enq...)
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range sts {
		if st.State != worker.JobDone || st.Seq != enq[i].Seq {
			t.Fatalf("status %d: %+v, want job %s done", i, st, enq[i].Ref())
		}
	}
	wrong := enq[len(enq)-1]
	wrong.Partition = 1 - wrong.Partition
	if _, err := p.Wait(ctx, append(enq[:len(enq)-1:len(enq)-1], wrong)...); err == nil {
		t.Fatalf("Wait took job %s as a job of partition %d", enq[len(enq)-1].Ref(), wrong.Partition)
	}
}
