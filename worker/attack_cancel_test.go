package worker_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
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
// ran. It fails if the old cancel skips it.
func TestAttackCancelOfDelayedJobSkipsLaterJobOfItsID(t *testing.T) {
	if os.Getenv("LEASEHOLD_ATTACK_OPEN") == "" {
		t.Skip("known defect: a delayed job's cancel also skips every later job with its ID, and Status calls that job done")
	}
	e := newShortDupEnv(t, 1)
	ctx := ctxFor(t, 90*time.Second)
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n, Bucket: e.bucket})
	if err != nil {
		t.Fatal(err)
	}
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
// same (correctly: its attempt completed under a live epoch). The jobs
// guide promises that a cancelled job's effects are never applied; the
// test fails if Status says cancelled for a job whose effect a sink
// applied.
func TestAttackCancelAfterCompletionBeforeHandOff(t *testing.T) {
	if os.Getenv("LEASEHOLD_ATTACK_OPEN") == "" {
		t.Skip("known defect: a job completed but not committed before a fail-over, then cancelled, has its effect applied and Status says cancelled")
	}
	e := newEnv(t, 1, natstestListen()...)
	ctx := ctxFor(t, 2*time.Minute)
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n, Bucket: e.bucket})
	if err != nil {
		t.Fatal(err)
	}
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

	px := natstest.NewProxy(t, e.srv.URL())
	ncA, err := nats.Connect(px.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ncA.Close)
	jsA, err := jetstream.New(ncA)
	if err != nil {
		t.Fatal(err)
	}
	bucketA, err := coordinator.OpenBucket(ctxFor(t, 10*time.Second), jsA, e.bucket.Name())
	if err != nil {
		t.Fatal(err)
	}
	emit := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		return job.Emit(ctx, []byte("effect of "+string(job.Data)))
	})
	recA := newRecorder()
	cfgA := e.config("a", emit)
	cfgA.JetStream, cfgA.Bucket = jsA, bucketA
	cfgA.Coordinator.TTL, cfgA.Coordinator.Margin = time.Second, 100*time.Millisecond
	cfgA.CommitEvery = time.Hour // nothing committed before the pause
	cfgA.Observer = recA
	a := start(t, cfgA)

	x, err := p.EnqueueTo(ctx, 0, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
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
	if sts[0].State == worker.JobCancelled && n > 0 {
		t.Fatalf("job %s: Status says %q (%s), yet a sink applied its effect %d times", x.Ref(), sts[0].State, sts[0].Detail, n)
	}
	if sts[0].State != worker.JobDone && sts[0].State != worker.JobCancelled {
		t.Fatalf("job %s ended %q", x.Ref(), sts[0].State)
	}
}
