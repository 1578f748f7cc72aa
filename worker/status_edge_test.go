package worker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A job reference names a partition and a sequence, and both come from a
// user (`leasehold jobs show 0:7`). A sequence that holds another
// partition's job, or no job at all, is not that partition's job: its
// status must not say done because the partition's progress passed the
// number, nor pending for ever because it never will.
func TestStatusOfAJobThatIsNotThere(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, time.Minute)
	p := e.statusProducer(t)
	// Partition 1's job first, then partition 0's, which partition 0's
	// worker finishes: its progress passes partition 1's sequence.
	other, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.WithKind("slow"))
	if err != nil {
		t.Fatal(err)
	}
	mine, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.WithKind("fast"))
	if err != nil {
		t.Fatal(err)
	}
	mux := worker.NewMux()
	block := make(chan struct{})
	mux.HandleKind("fast", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	mux.HandleKind("slow", worker.HandlerFunc(func(ctx context.Context, _ *worker.Job) error {
		select {
		case <-block:
		case <-ctx.Done():
		}
		return ctx.Err()
	}))
	start(t, e.config("w", mux))
	t.Cleanup(func() { close(block) }) // before the worker stops
	if _, err := p.Wait(ctx, mine); err != nil {
		t.Fatal(err)
	}

	forged := worker.Enqueued{Partition: 0, Seq: other.Seq}
	st, err := p.Status(ctx, forged)
	if err == nil && st.State != worker.JobUnknown {
		t.Errorf("status of %s, which is partition 1's job %d: %+v; want unknown", forged.Ref(), other.Seq, st)
	}
	never := worker.Enqueued{Partition: 0, Seq: mine.Seq + 1000}
	st, err = p.Status(ctx, never)
	if err == nil && st.State != worker.JobUnknown {
		t.Errorf("status of %s, past the stream's last sequence: %+v; want unknown", never.Ref(), st)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := p.Wait(wctx, never); err == nil || strings.Contains(err.Error(), "deadline") {
		t.Errorf("Wait for %s, which no job holds: %v; want an error at once, not a wait for ever", never.Ref(), err)
	}
}

// A job removed from the stream before its partition reached it (aged
// out, deleted by hand) will never run: its status says so, not pending,
// and Wait does not wait for it.
func TestStatusOfAJobRemovedUnrun(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	p := e.statusProducer(t)
	gone, err := p.EnqueueTo(ctx, 0, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("y")); err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteMsg(ctx, gone.Seq); err != nil {
		t.Fatal(err)
	}
	st, err := p.Status(ctx, gone)
	if err != nil || st.State != worker.JobRemovedUnrun {
		t.Errorf("status of a job deleted before it ran: %+v, %v; want removed unrun", st, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if sts, err := p.Wait(wctx, gone); err != nil || sts[0].State != worker.JobRemovedUnrun {
		t.Errorf("Wait for a job deleted before it ran: %+v, %v; want removed unrun at once", sts, err)
	}
}
