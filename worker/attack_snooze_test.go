package worker_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A job that snoozes again and again holds up the jobs of its key behind
// it, and the partition's committed progress stays below it. The jobs
// guide says its partition is then reported stalled after StallAfter
// (Stalled, Ready, the gauge). The test has a job snooze for a fifth of
// StallAfter, over and over, with a job of its key waiting behind it,
// FetchWait below StallAfter as with the defaults (5 s and 2 min), and
// fails unless Ready reports the partition within eight times StallAfter.
//
// Each pull that found nothing used to count as caught up, although the
// jobs fetched were unfinished: the partition never showed as stalled.
func TestAttackSnoozeForEverShowsAsStalled(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	const stallAfter = time.Second
	mux := worker.NewMux()
	worker.Handle(mux, "nap", func(ctx context.Context, j *worker.Job, name string) error {
		if name == "sleeper" {
			return worker.Snooze(stallAfter / 5)
		}
		return nil
	})
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.MaxSnoozes, cfg.StallAfter, cfg.Observer = 1_000_000, stallAfter, rec
	cfg.FetchWait = stallAfter / 5 // as with the defaults (5 s against 2 min): pulls expire well within StallAfter
	p := e.producer(t)
	for _, name := range []string{"sleeper", "behind"} {
		if _, err := worker.Enqueue(ctx, p, "nap", name, worker.WithKey([]byte("k"))); err != nil {
			t.Fatal(err)
		}
	}
	w := start(t, cfg)
	var ready error
	for n := 1; n <= 40; n++ { // 40 snoozes of StallAfter/5: 8 × StallAfter
		rec.waitFor(t, 20*time.Second, "another snooze", func() bool {
			return rec.count(kind(worker.EventJobSnoozed)) >= n
		})
		if ready = w.w.Ready(ctx); ready != nil {
			break
		}
	}
	if ready == nil || !strings.Contains(ready.Error(), "no progress") {
		t.Fatalf("after %d snoozes (%v of a job that never finishes, with a job waiting behind it) Ready says %v and Stalled %+v; want the partition reported stalled after StallAfter (%v)",
			rec.count(kind(worker.EventJobSnoozed)), 8*stallAfter, ready, w.w.Stalled(), stallAfter)
	}
}

// A job in a retry backoff far longer than StallAfter holds up its key and
// the partition's committed progress, as a snoozing job does: its
// partition is reported stalled after StallAfter, although every pull
// finds nothing new.
func TestAttackLongBackoffShowsAsStalled(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	const stallAfter = time.Second
	mux := worker.NewMux()
	worker.Handle(mux, "nap", func(ctx context.Context, j *worker.Job, name string) error {
		if name == "failing" {
			return errors.New("the bank is closed")
		}
		return nil
	}, worker.MaxAttempts(3), worker.Backoff(func(int) time.Duration { return time.Hour }))
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.StallAfter, cfg.Observer = stallAfter, rec
	cfg.FetchWait = stallAfter / 5
	p := e.producer(t)
	for _, name := range []string{"failing", "behind"} {
		if _, err := worker.Enqueue(ctx, p, "nap", name, worker.WithKey([]byte("k"))); err != nil {
			t.Fatal(err)
		}
	}
	w := start(t, cfg)
	rec.waitFor(t, 20*time.Second, "the first failure", func() bool { return rec.count(kind(worker.EventJobFailed)) >= 1 })
	// Pulls expire every StallAfter/5: give it eight times StallAfter.
	deadline := time.Now().Add(8 * stallAfter)
	for {
		ready := w.w.Ready(ctx)
		if ready != nil && strings.Contains(ready.Error(), "no progress") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a job in a backoff of an hour, with a job waiting behind it: Ready says %v and Stalled %+v %v after its failure; want the partition reported stalled after StallAfter (%v)",
				ready, w.w.Stalled(), 8*stallAfter, stallAfter)
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(stallAfter / 10): // a stall is a time: look again
		}
	}
}
