package worker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// A job that snoozes runs again without using up an attempt: with one
// attempt allowed, three snoozes and a success complete it.
func TestSnoozeRunsAgainWithoutAnAttempt(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 30*time.Second)
	var runs atomic.Int64
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		n := runs.Add(1)
		if err := j.Emit(ctx, []byte(fmt.Sprint("run ", n))); err != nil {
			return err
		}
		if n <= 3 {
			return fmt.Errorf("not yet: %w", worker.Snooze(5*time.Millisecond))
		}
		return nil
	}))
	cfg.MaxAttempts = 1
	cfg.Observer = rec
	q, err := e.producer(t).EnqueueTo(ctx, 0, []byte("job"))
	if err != nil {
		t.Fatal(err)
	}
	start(t, cfg)
	rec.waitFor(t, 20*time.Second, "the job finished or dead-lettered", func() bool {
		return rec.count(kind(worker.EventJobFinished))+rec.count(kind(worker.EventJobDeadLettered)) == 1
	})
	if n := rec.count(kind(worker.EventJobDeadLettered)) + rec.count(kind(worker.EventJobFailed)); n != 0 {
		t.Fatalf("%d failures or dead letters, want none", n)
	}
	var snoozed []worker.Event
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobSnoozed {
			snoozed = append(snoozed, ev)
		}
	}
	if len(snoozed) != 3 {
		t.Fatalf("%d snoozed events, want 3", len(snoozed))
	}
	for i, ev := range snoozed {
		if ev.Seq != q.Seq || ev.Attempt != i+1 || ev.Backoff != 5*time.Millisecond || ev.Kind.String() != "job_snoozed" {
			t.Errorf("snooze %d: %+v", i+1, ev)
		}
	}
	// The snoozed attempts' effects never left: the output holds the
	// fourth run's alone (after the partition's barrier).
	var out []string
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		if !isBarrier(m) {
			out = append(out, string(m.Data()))
		}
	}
	if strings.Join(out, ",") != "run 4" {
		t.Errorf("effects %q, want the last run's alone", out)
	}
}

// A job snoozing holds its key: the job after it of the same key waits,
// while a job of another key runs beside it (here the snoozing job waits
// for that one to finish, and that one for the first snooze).
func TestSnoozeKeepsItsKeysOrder(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 30*time.Second)
	var mu sync.Mutex
	var log []string
	note := func(s string) {
		mu.Lock()
		log = append(log, s)
		mu.Unlock()
	}
	otherDone, snoozed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	mux := worker.NewMux()
	worker.Handle(mux, "step", func(ctx context.Context, _ *worker.Job, name string) error {
		switch name {
		case "k1":
			select {
			case <-otherDone:
			default:
				note("k1 snoozes")
				once.Do(func() { close(snoozed) })
				return worker.Snooze(2 * time.Millisecond)
			}
		case "other":
			// It runs beside k1 and lets k1 finish, once k1 has snoozed.
			select {
			case <-snoozed:
			case <-ctx.Done():
				return ctx.Err()
			}
			defer close(otherDone)
		}
		note(name + " done")
		return nil
	})
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Order, cfg.PartitionConcurrency = worker.OrderKey, 4
	cfg.MaxAttempts, cfg.MaxSnoozes = 1, 10000
	cfg.Observer = rec
	p := e.producer(t)
	for _, j := range []struct{ name, key string }{{"k1", "k"}, {"k2", "k"}, {"other", "o"}} {
		if _, err := worker.Enqueue(ctx, p, "step", j.name, worker.WithKey([]byte(j.key))); err != nil {
			t.Fatal(err)
		}
	}
	start(t, cfg)
	rec.waitFor(t, 20*time.Second, "every job finished or dead-lettered", func() bool {
		return rec.count(kind(worker.EventJobFinished))+rec.count(kind(worker.EventJobDeadLettered)) == 3
	})
	if n := rec.count(kind(worker.EventJobDeadLettered)); n != 0 {
		t.Fatalf("%d jobs dead-lettered, want none", n)
	}
	mu.Lock()
	defer mu.Unlock()
	at := map[string]int{}
	for i, s := range log {
		at[s] = i
	}
	if at["k2 done"] < at["k1 done"] {
		t.Errorf("k2 ran before the snoozing k1 of its key finished: %v", log)
	}
	if rec.count(kind(worker.EventJobSnoozed)) == 0 || at["other done"] > at["k1 done"] {
		t.Errorf("k1 did not snooze while the other key ran: %v", log)
	}
}

// Snoozes are bounded: past MaxSnoozes a snooze is a failed attempt,
// retried and then dead-lettered saying why.
func TestSnoozeLimitIsAFailure(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 30*time.Second)
	rec := newRecorder()
	mux := worker.NewMux()
	worker.Handle(mux, "forever", func(ctx context.Context, _ *worker.Job, _ string) error {
		return worker.Snooze(time.Millisecond)
	}, worker.MaxSnoozes(2))
	cfg := e.config("w", mux)
	cfg.MaxAttempts, cfg.MaxSnoozes = 2, 1000
	cfg.Observer = rec
	if _, err := worker.Enqueue(ctx, e.producer(t), "forever", "x"); err != nil {
		t.Fatal(err)
	}
	start(t, cfg)
	rec.waitFor(t, 20*time.Second, "the job dead-lettered", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) == 1 })
	if n := rec.count(kind(worker.EventJobSnoozed)); n != 2 {
		t.Errorf("%d snoozes, want the kind's 2", n)
	}
	failed := 0
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobFailed {
			failed++
			if !errors.Is(ev.Err, worker.ErrSnoozeLimit) {
				t.Errorf("failure %d: %v, want the snooze limit", failed, ev.Err)
			}
		}
	}
	if failed != 2 {
		t.Errorf("%d failed attempts, want MaxAttempts' 2", failed)
	}
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 || !strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "snoozed 4 times") {
		t.Fatalf("dead letters: %d, error %q", len(dlq), dlq[0].Headers().Get(worker.HeaderError))
	}
}
