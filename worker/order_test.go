package worker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/worker"
)

// With MaxInFlight 1 a partition's effects reach the log in job order even
// when one fails and the partition is run again from its job: the next job
// does not start until every effect of the one before is acknowledged. The
// failing publish is a real refusal of the server: the destination keeps
// one message per subject and refuses a second (DiscardNewPerSubject)
// until the test removes the one in the way.
func TestOneInFlightKeepsJobOrderAcrossARewind(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	dest, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "ORDER", Subjects: []string{"order.>"}, Storage: jetstream.FileStorage,
		MaxMsgsPerSubject: 1, Discard: jetstream.DiscardNew, DiscardNewPerSubject: true, MaxMsgs: -1, MaxBytes: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	blocker, err := e.js.Publish(ctx, "order.key-0", []byte("in the way"))
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Publish(ctx, "order."+string(j.Data), j.Data)
	}))
	cfg.Observer = rec
	cfg.MaxInFlight = 1
	cfg.MaxAttempts = 1_000_000 // the refusal is not the job's fault; the test removes it
	start(t, cfg)
	enq := e.enqueue(t, 0, 3) // key-0 is refused until the blocker goes

	rec.waitFor(t, 30*time.Second, "a refused publish of the first job, run again", func() bool {
		return rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobFailed && ev.Seq == enq[0].Seq }) >= 2
	})
	// The later jobs have not run: nothing of theirs is in the log.
	for _, m := range readStream(t, e.js, "ORDER") {
		if m.Subject() != "order.key-0" {
			t.Fatalf("%s stored while the job before it had an effect refused", m.Subject())
		}
	}
	if err := dest.DeleteMsg(ctx, blocker.Sequence); err != nil {
		t.Fatal(err)
	}
	rec.waitCommitted(t, 30*time.Second, enq[len(enq)-1].Seq)
	var order []string
	for _, m := range readStream(t, e.js, "ORDER") {
		if keyOf(m.Headers()) != "" {
			order = append(order, strings.TrimPrefix(m.Subject(), "order."))
		}
	}
	if got, want := strings.Join(order, " "), "key-0 key-1 key-2"; got != want {
		t.Fatalf("effects in the log in the order %q, want the jobs' order %q", got, want)
	}
}
