package worker_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// newShortDupEnv is newEnv with a job stream whose duplicate window is one
// second, so that a job ID can be used again within a test.
func newShortDupEnv(t *testing.T, n int) *env {
	t.Helper()
	srv := natstest.Start(t)
	e := &env{srv: srv, prefix: "jobs", n: n}
	e.js = srv.JetStream(t)
	if err := worker.ProvisionJobs(ctxFor(t, 30*time.Second), e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: n, Schedules: true, Duplicates: time.Second}); err != nil {
		t.Fatal(err)
	}
	e.bucket = e.provisionBucket(t)
	return e
}

// A cancel of a delayed job is stored under its job ID, and the runner
// matches it against every job carrying that ID, not only the job it was
// asked for. A job enqueued later with the same ID (once the duplicate
// window has passed, so the stream stores it as a new job) was never
// cancelled: it must run, and Status must not call it done unless it
// ran. It fails if the old cancel skips it (the runner matched the record
// of a delayed job's cancel against any job of its ID, and Status looked
// for the later job's cancel under its sequence, found none, and said
// done).
func TestAttackCancelOfDelayedJobSkipsLaterJobOfItsID(t *testing.T) {
	e := newShortDupEnv(t, 1)
	ctx := ctxFor(t, 90*time.Second)
	p := e.statusProducer(t)
	var mu sync.Mutex
	ran := map[string]int{}
	start(t, e.config("w1", worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		mu.Lock()
		ran[string(job.Data)]++
		mu.Unlock()
		return job.Emit(ctx, []byte("effect of "+string(job.Data)))
	})))

	delayed, err := p.EnqueueTo(ctx, 0, []byte("first"), worker.JobID("order-42"), worker.EnqueueIn(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Cancel(ctx, delayed); err != nil {
		t.Fatal(err)
	}
	sts, err := p.Wait(ctx, delayed)
	if err != nil || sts[0].State != worker.JobCancelled {
		t.Fatalf("the cancelled delayed job: %+v, %v", sts, err)
	}

	// The same ID again, as a new job, once the window lets it in.
	var second worker.Enqueued
	for {
		second, err = p.EnqueueTo(ctx, 0, []byte("second"), worker.JobID("order-42"))
		if err != nil {
			t.Fatal(err)
		}
		if !second.Duplicate {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the duplicate window never let the ID in again")
		case <-time.After(200 * time.Millisecond): // the window is a time: wait it out
		}
	}
	sts, err = p.Wait(ctx, second)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	n := ran["second"]
	mu.Unlock()
	if n != 1 || sts[0].State != worker.JobDone {
		t.Fatalf("job %s, never cancelled, ran %d times and Status says %q (%s); want it run once and done",
			second.Ref(), n, sts[0].State, sts[0].Detail)
	}
}

// A job whose attempt completed (its effect and final are in the effect
// log, and a stream sink applied them) but whose progress its worker had
// not committed when it froze past its TTL, is still "running" to Status,
// so Cancel takes it. The successor runs it again, finds the cancel, skips
// it and records it as cancelled. The job's effect was applied all the
// same (correctly: its attempt completed under a live epoch). A cancel is
// best effort against an attempt that has completed: the successor cannot
// tell whether its predecessor completed the job, and Status must not say
// "cancelled" as though no effect of it were applied. The test fails if
// Status says cancelled for a job whose effect a sink applied without
// saying that an attempt under an earlier epoch may have completed it.
func TestAttackCancelAfterCompletionBeforeHandOff(t *testing.T) {
	e := newEnv(t, 1, natstestListen()...)
	ctx := ctxFor(t, 2*time.Minute)
	p := e.statusProducer(t)
	var mu sync.Mutex
	applied := map[string]int{}
	appliedX := make(chan struct{}, 16)
	startSink(t, e, func(_ context.Context, ef sink.Effect) error {
		mu.Lock()
		applied[string(ef.Data)]++
		mu.Unlock()
		if string(ef.Data) == "effect of x" {
			appliedX <- struct{}{}
		}
		return nil
	})

	px, _, jsA, bucketA := e.proxied(t)
	emit := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		return job.Emit(ctx, []byte("effect of "+string(job.Data)))
	})
	// A's y runs until A's lease is lost: its partition is never caught
	// up, so A commits only on its tick, an hour away.
	emitA := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		if string(job.Data) == "y" {
			<-ctx.Done()
			return ctx.Err()
		}
		return emit(ctx, job)
	})
	recA := newRecorder()
	cfgA := e.config("a", emitA)
	cfgA.JetStream, cfgA.Bucket = jsA, bucketA
	cfgA.Coordinator.TTL, cfgA.Coordinator.Margin = time.Second, 100*time.Millisecond
	cfgA.CommitEvery = time.Hour // nothing committed before the pause
	cfgA.Observer = recA

	// Both are stored before A starts, so A reads them together; without
	// a key they run in partition order, y after x.
	x, err := p.EnqueueTo(ctx, 0, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("y")); err != nil {
		t.Fatal(err)
	}
	a := start(t, cfgA)
	select {
	case <-appliedX:
	case <-ctx.Done():
		t.Fatal("the sink never applied x's effect")
	}
	px.Freeze() // A pauses before committing
	recA.waitFor(t, 30*time.Second, "A to see its lease lost", func() bool { return recA.count(kind(worker.EventPartitionLost)) > 0 })

	before, err := p.Cancel(ctx, x)
	if err != nil {
		t.Fatalf("cancel of a job whose progress is not committed: %v", err)
	}
	t.Logf("Cancel found job %s %s (%s)", x.Ref(), before.State, before.Detail)

	recB := newRecorder()
	cfgB := e.config("b", emit)
	cfgB.Coordinator.TTL = time.Second
	cfgB.Observer = recB
	start(t, cfgB)
	sts, err := p.Wait(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	px.Thaw()
	a.stop(t)
	mu.Lock()
	n := applied["effect of x"]
	mu.Unlock()
	if sts[0].State == worker.JobCancelled && n > 0 && !strings.Contains(sts[0].Detail, "an attempt under an earlier epoch may have completed it") {
		t.Fatalf("job %s: Status says %q (%s), yet a sink applied its effect %d times", x.Ref(), sts[0].State, sts[0].Detail, n)
	}
	if sts[0].State != worker.JobDone && sts[0].State != worker.JobCancelled {
		t.Fatalf("job %s ended %q", x.Ref(), sts[0].State)
	}
}

// Cancels are keyed by partition and sequence and kept until the bucket
// is purged. A job stream deleted and provisioned again (an operator
// starting over, a restore) numbers its jobs from 1 again, while the
// bucket of cancels keeps its records: a new job at a sequence an old,
// cancelled job held was skipped without running: a record now names the
// time its job was stored. The test cancels the first job of a stream,
// lets a worker skip it, makes the stream again, and fails unless the new
// first job, never cancelled, runs and is done.
func TestAttackCancelOutlivesItsJobStream(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 90*time.Second)
	p := e.statusProducer(t)
	var mu sync.Mutex
	ran := map[string]int{}
	h := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		mu.Lock()
		ran[string(job.Data)]++
		mu.Unlock()
		return job.Emit(ctx, []byte("effect of "+string(job.Data)))
	})
	old, err := p.EnqueueTo(ctx, 0, []byte("old"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Cancel(ctx, old); err != nil {
		t.Fatal(err)
	}
	w := start(t, e.config("w1", h))
	if sts, err := p.Wait(ctx, old); err != nil || sts[0].State != worker.JobCancelled {
		t.Fatalf("the old job: %+v, %v", sts, err)
	}
	w.stop(t)

	// Start over: the job stream, and the fence records that hold its
	// progress, made again; the cancels bucket is left as it is.
	if err := e.js.DeleteStream(ctx, worker.JobsStream(e.prefix)); err != nil {
		t.Fatal(err)
	}
	e.srv.Restart(t)
	e.js = e.srv.JetStream(t)
	if err := worker.ProvisionJobs(ctx, e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: e.n, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{e.prefix + "-leases", e.prefix + "-leases-fences"} {
		_ = e.js.DeleteKeyValue(ctx, b)
	}
	e.bucket = e.provisionBucket(t)
	p = e.statusProducer(t)
	fresh, err := p.EnqueueTo(ctx, 0, []byte("new"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the old job was %s, the new one is %s", old.Ref(), fresh.Ref())
	start(t, e.config("w2", h))
	sts, err := p.Wait(ctx, fresh)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	n := ran["new"]
	mu.Unlock()
	if n != 1 || sts[0].State != worker.JobDone {
		t.Fatalf("job %s of the new stream, never cancelled, ran %d times; Status says %q (%s)", fresh.Ref(), n, sts[0].State, sts[0].Detail)
	}
}
