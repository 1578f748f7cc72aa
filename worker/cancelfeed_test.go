package worker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A worker follows the cancels of every partition it holds through one
// watch of the bucket, not one per partition, and hands each cancel to
// the partition it names: a cancel of a running job on one partition ends
// that job alone, while the same worker runs another partition's.
func TestOneWatchOfCancelsPerWorker(t *testing.T) {
	const n = 4
	e := newEnv(t, n)
	ctx := ctxFor(t, 90*time.Second)
	p := e.statusProducer(t)
	started := make(chan leasehold.Partition, n)
	causes := make(chan error, n)
	release := make(chan struct{})
	h := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		started <- job.Partition
		select {
		case <-ctx.Done():
			causes <- context.Cause(ctx)
			return context.Cause(ctx)
		case <-release:
			return job.Emit(ctx, []byte("done"))
		}
	})
	jobs := make([]worker.Enqueued, n)
	for i := range jobs {
		var err error
		if jobs[i], err = p.EnqueueTo(ctx, leasehold.Partition(i), []byte("block")); err != nil {
			t.Fatal(err)
		}
	}
	start(t, e.config("w1", h))
	for range n {
		select {
		case <-started:
		case <-ctx.Done():
			t.Fatal("not every partition's job started")
		}
	}
	// Every partition is ready, so each one's read of what was stored
	// is over, and its consumer deleted as its watch stopped: the bucket
	// has the worker's watch as its one consumer.
	stream, err := e.js.Stream(ctx, "KV_"+worker.CancelBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	consumers := info.State.Consumers
	if consumers != 1 {
		t.Fatalf("the bucket of cancels has %d consumers with %d partitions held, want the worker's one", consumers, n)
	}

	if _, err := p.Cancel(ctx, jobs[2]); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-causes:
		if !errors.Is(err, worker.ErrJobCancelled) {
			t.Fatalf("a job's context ended with %v, want ErrJobCancelled", err)
		}
	case <-ctx.Done():
		t.Fatal("the running job's context was not cancelled")
	}
	close(release)
	sts, err := p.Wait(ctx, jobs...)
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range sts {
		want := worker.JobDone
		if i == 2 {
			want = worker.JobCancelled
		}
		if st.State != want {
			t.Errorf("partition %d's job: %v, want %v", i, st.State, want)
		}
	}
	select {
	case err := <-causes:
		t.Fatalf("another job's context ended too: %v", err)
	default:
	}
}
