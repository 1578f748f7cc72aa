package worker_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/worker"
)

// A schedule published straight to a partition's subject is stored there
// (the server adds a roll-up to it, purging that partition's jobs) and
// fires on its target for as long as it is stored; Unschedule cannot name
// it. The worker dead-letters it and, once the dead letter is stored,
// removes it from the job stream, so that it fires no more.
func TestScheduleForgedOnAPartitionSubject(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, time.Minute)
	forged := &nats.Msg{Subject: worker.JobSubject(e.prefix, 0), Data: []byte(`{}`), Header: nats.Header{
		"Nats-Schedule": []string{"@every 1s"}, "Nats-Schedule-Target": []string{worker.JobSubject(e.prefix, 1)}, worker.HeaderKind: []string{"email"},
	}}
	ack, err := e.js.PublishMsg(ctx, forged)
	if err != nil {
		t.Skipf("the server refused a schedule on a partition subject: %v", err)
	}
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(context.Context, *worker.Job, email) error { return nil })
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the forged schedule to be dead-lettered", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) >= 1 })
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if why := dlq[0].Headers().Get(worker.HeaderError); !strings.Contains(why, "Nats-Rollup") {
		t.Errorf("the forged schedule's dead letter says %q", why)
	}
	if got := dlq[0].Headers().Get(worker.HeaderSeq); got != strconv.FormatUint(ack.Sequence, 10) {
		t.Errorf("the dead letter names job %s, want the schedule at %d", got, ack.Sequence)
	}
	// Once its dead letter is stored, the schedule is gone from the job
	// stream: nothing is left that could fire.
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	for {
		_, err := s.GetMsg(ctx, ack.Sequence)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil && ctx.Err() != nil {
			t.Fatalf("the forged schedule at %d is still stored after its dead letter: %v", ack.Sequence, err)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the forged schedule at %d is still stored after its dead letter", ack.Sequence)
		case <-time.After(20 * time.Millisecond):
		}
	}
	// Progress moves past it without the partition going back to it: the
	// dead letter's acknowledgement was seen once, not waited for again
	// until it timed out.
	rec.waitFor(t, 30*time.Second, "progress past the forged schedule", func() bool {
		return rec.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventProgressCommitted && ev.Lease.Partition == 0 && ev.Seq >= ack.Sequence
		}) > 0
	})
	if n := rec.count(kind(worker.EventJobFailed)); n != 1 {
		for _, ev := range rec.all() {
			if ev.Kind == worker.EventJobFailed {
				t.Logf("job %d failed: %v", ev.Seq, ev.Err)
			}
		}
		t.Fatalf("%d failures, want the forged schedule's one", n)
	}
}
