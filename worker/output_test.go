package worker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

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
		keys = append(keys, m.Headers().Get(leasehold.HeaderKey))
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
