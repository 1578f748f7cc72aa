package worker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// What the worker writes for jobs' effects: each effect carries its job
// and attempt, the last one on a subject is marked final with the count
// and the job before it, a job of one effect sends one message, and a
// failed attempt that sent effects closes them with an abort marker.
func TestJobEffectsOnTheWire(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		switch string(j.Data) {
		case "key-0":
			return j.Emit(ctx, []byte("one"))
		case "key-1":
			for i := range 3 {
				if err := j.Emit(ctx, []byte(fmt.Sprint(i))); err != nil {
					return err
				}
			}
		case "key-2":
			if err := j.Emit(ctx, []byte("a")); err != nil {
				return err
			}
			if err := j.Emit(ctx, []byte("b")); err != nil {
				return err
			}
			if j.Attempt == 1 {
				return errors.New("fails after two effects")
			}
		}
		return nil
	})
	cfg := e.config("w", h)
	cfg.Observer = rec
	cfg.Order = worker.OrderPartition // the wire of a runner that runs one job at a time
	start(t, cfg)
	enq := e.enqueue(t, 0, 4)
	rec.waitFor(t, time.Minute, "every job", func() bool { return rec.count(kind(worker.EventJobFinished)) == 4 })
	var marks []leasehold.JobMark
	var keys []string
	msgs := readStream(t, e.js, worker.EffectsStream(e.prefix))
	for _, m := range msgs {
		if isBarrier(m) {
			continue
		}
		mk, err := leasehold.JobMarkFromHeader(m.Headers())
		if err != nil {
			t.Fatal(err)
		}
		marks = append(marks, mk)
		keys = append(keys, keyOf(m.Headers()))
	}
	s0, s1, s2 := enq[0].Seq, enq[1].Seq, enq[2].Seq
	want := []leasehold.JobMark{
		{Job: s0, Attempt: 1, Effects: 1, After: 0},
		{Job: s1, Attempt: 2}, {Job: s1, Attempt: 2}, {Job: s1, Attempt: 2, Effects: 3, After: s0},
		{Job: s2, Attempt: 3}, {Job: s2, Attempt: 3, Abort: true},
		{Job: s2, Attempt: 4}, {Job: s2, Attempt: 4, Effects: 2, After: s1},
	}
	if len(marks) != len(want) {
		t.Fatalf("%d messages (%v, keys %v), want %d: %v", len(marks), marks, keys, len(want), want)
	}
	for i := range want {
		if marks[i] != want[i] {
			t.Errorf("message %d (key %s): %+v, want %+v", i, keys[i], marks[i], want[i])
		}
	}
	if k := keys[5]; k != worker.AbortKey(e.prefix, 0, s2, 3) {
		t.Errorf("abort marker key %q", k)
	}
}

// A rewind forgets what the rewound jobs did to the chain of finals: each
// re-run names the job that completed before it, not itself or a job that
// is to run again. The publish that fails is a real refusal: the
// destination holds two messages and refuses a third until the test
// removes the one in the way.
func TestRewindKeepsTheChainOfFinals(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	dest, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "CHAIN", Subjects: []string{"chain.>"}, Storage: jetstream.FileStorage,
		MaxMsgs: 2, Discard: jetstream.DiscardNew, MaxBytes: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	blocker, err := e.js.Publish(ctx, "chain.x", []byte("in the way"))
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Publish(ctx, "chain.x", j.Data)
	}))
	cfg.Observer = rec
	cfg.MaxAttempts = 1_000_000
	cfg.Order = worker.OrderPartition // the chain of a runner that runs one job at a time
	start(t, cfg)
	enq := e.enqueue(t, 0, 3)
	rec.waitFor(t, 30*time.Second, "a refused publish, run again", func() bool {
		return rec.count(kind(worker.EventJobFailed)) >= 2
	})
	if err := dest.DeleteMsg(ctx, blocker.Sequence); err != nil {
		t.Fatal(err)
	}
	if _, err := e.js.UpdateStream(ctx, jetstream.StreamConfig{Name: "CHAIN", Subjects: []string{"chain.>"}, Storage: jetstream.FileStorage, MaxMsgs: -1, MaxBytes: -1}); err != nil {
		t.Fatal(err)
	}
	rec.waitCommitted(t, 30*time.Second, enq[len(enq)-1].Seq)
	last := map[uint64]leasehold.JobMark{}
	for _, m := range readStream(t, e.js, "CHAIN") {
		mk, err := leasehold.JobMarkFromHeader(m.Headers())
		if err != nil {
			t.Fatalf("a final the sinks would refuse: %v", err)
		}
		if mk.Final() {
			last[mk.Job] = mk
		}
	}
	want := map[uint64]uint64{enq[0].Seq: 0, enq[1].Seq: enq[0].Seq, enq[2].Seq: enq[1].Seq}
	for job, after := range want {
		if mk, ok := last[job]; !ok || mk.After != after {
			t.Errorf("job %d: last final %+v (stored: %v), want After %d", job, mk, ok, after)
		}
	}
}
