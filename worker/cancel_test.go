package worker_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A cancelled job does not run when its turn comes (waiting or delayed);
// a running one sees its context end with the cause ErrJobCancelled, and
// its effects are aborted even though its handler returns nil. Status says
// cancelled; a cancel of a finished job says so.
func TestCancelJobs(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 90*time.Second)
	p := e.statusProducer(t)
	started, cause := make(chan struct{}), make(chan error, 1)
	var mu sync.Mutex
	ran := map[string]int{}
	h := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		mu.Lock()
		ran[string(job.Data)]++
		mu.Unlock()
		if string(job.Data) != "block" {
			return job.Emit(ctx, []byte("effect of "+string(job.Data)))
		}
		if err := job.Emit(ctx, []byte("first")); err != nil {
			return err
		}
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		// Returned nil after the cancel: its effects must still not apply.
		_ = job.Emit(context.WithoutCancel(ctx), []byte("second"))
		return nil
	})

	delayed, err := p.EnqueueTo(ctx, 0, []byte("delayed"), worker.EnqueueIn(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := p.Cancel(ctx, delayed); err != nil || st.State != worker.JobScheduled {
		t.Fatalf("cancel a delayed job: %+v, %v", st, err)
	}
	a, _ := p.EnqueueTo(ctx, 0, []byte("block"))
	b, _ := p.EnqueueTo(ctx, 0, []byte("waiting"))
	c, err := p.EnqueueTo(ctx, 0, []byte("normal"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Cancel(ctx, b); err != nil {
		t.Fatal(err)
	}
	if st, err := p.Status(ctx, b); err != nil || st.State != worker.JobPending || st.Detail == "" {
		t.Fatalf("a waiting job with a cancel: %+v, %v", st, err)
	}

	start(t, e.config("w1", h))
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the blocking job never started")
	}
	if _, err := p.Cancel(ctx, a); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-cause:
		if !errors.Is(err, worker.ErrJobCancelled) {
			t.Fatalf("the running job's context ended with %v, want ErrJobCancelled", err)
		}
	case <-ctx.Done():
		t.Fatal("the running job's context was not cancelled")
	}
	sts, err := p.Wait(ctx, c, delayed, a, b)
	if err != nil {
		t.Fatal(err)
	}
	if sts[0].State != worker.JobDone || sts[1].State != worker.JobCancelled || sts[2].State != worker.JobCancelled || sts[3].State != worker.JobCancelled {
		t.Fatalf("Wait says %+v: want done, then cancelled three times", sts)
	}
	for _, ref := range []worker.Enqueued{a, b, delayed} {
		st, err := p.Status(ctx, ref)
		if err != nil || st.State != worker.JobCancelled {
			t.Fatalf("job %s: %+v, %v; want cancelled", ref.Ref(), st, err)
		}
	}
	if st, err := p.Status(ctx, c); err != nil || st.State != worker.JobDone {
		t.Fatalf("the job after them: %+v, %v", st, err)
	}
	mu.Lock()
	if ran["waiting"] != 0 || ran["delayed"] != 0 || ran["normal"] != 1 {
		t.Fatalf("handlers ran %v: the cancelled jobs must not run", ran)
	}
	mu.Unlock()
	if _, err := p.Cancel(ctx, c); !errors.Is(err, worker.ErrJobFinished) {
		t.Fatalf("cancel a done job: %v", err)
	}
	// The running job's attempt was aborted: no final of it, an abort.
	aborted := false
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		mk := markOf(m.Headers())
		if mk.Job != a.Seq {
			continue
		}
		if mk.Final() {
			t.Fatalf("the cancelled job's final was sent: %v", m.Headers())
		}
		aborted = aborted || mk.Abort
	}
	if !aborted {
		t.Fatal("the cancelled job's attempt was not aborted")
	}
}

// A cancel record is untrusted: one whose content does not match its key
// (another job's sequence, another partition, unknown fields) cancels
// nothing, and its job runs.
func TestForgedCancelIsIgnored(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	p := e.statusProducer(t)
	x, err := p.EnqueueTo(ctx, 1, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := e.js.KeyValue(ctx, worker.CancelBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	key := "1.s" + strconv.FormatUint(x.Seq, 10)
	if _, err := kv.Put(ctx, key, []byte(`{"ref":"1:1","partition":1,"seq":`+strconv.FormatUint(x.Seq+1, 10)+`,"at":"2026-01-01T00:00:00Z"}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "0.s"+strconv.FormatUint(x.Seq, 10), []byte(`{"ref":"x","partition":1,"seq":`+strconv.FormatUint(x.Seq, 10)+`,"at":"2026-01-01T00:00:00Z"}`)); err != nil {
		t.Fatal(err)
	}
	ran := make(chan struct{}, 1)
	start(t, e.config("w1", worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		ran <- struct{}{}
		return nil
	})))
	sts, err := p.Wait(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-ran:
	default:
		t.Fatal("the job did not run")
	}
	if st, err := p.Status(ctx, x); err != nil || st.State != worker.JobDone {
		t.Fatalf("status %+v (wait said %+v), %v", st, sts, err)
	}
}
