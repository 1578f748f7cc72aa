package worker_test

import (
	"context"
	"os"
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
func TestAttackSnoozeForEverShowsAsStalled(t *testing.T) {
	if os.Getenv("LEASEHOLD_ATTACK_OPEN") == "" {
		t.Skip("known defect: a partition whose jobs are all fetched and one keeps snoozing never shows as stalled: each empty pull counts as caught up")
	}
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
