package worker_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

type kindJob struct{ Name string }

// Each kind fails every attempt under settings of its own: the kinds with
// options take as many attempts, wait the backoffs and time out as their
// options say, and the kind without keeps the worker's.
func TestKindOptionsOverrideTheWorkers(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	const kindBackoff = 3 * time.Millisecond
	mux := worker.NewMux()
	fail := func(ctx context.Context, _ *worker.Job, _ kindJob) error { return errors.New("no") }
	worker.Handle(mux, "once", fail, worker.MaxAttempts(1))
	worker.Handle(mux, "thrice", fail, worker.MaxAttempts(3), worker.Backoff(func(n int) time.Duration { return time.Duration(n) * kindBackoff }))
	worker.Handle(mux, "plain", fail)
	worker.Handle(mux, "slow", func(ctx context.Context, _ *worker.Job, _ kindJob) error {
		<-ctx.Done()
		return context.Cause(ctx)
	}, worker.Timeout(20*time.Millisecond), worker.MaxAttempts(2))
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.MaxAttempts = 4
	cfg.Backoff = func(int) time.Duration { return time.Millisecond }
	cfg.HandleTimeout = 3 * time.Second
	cfg.Observer = rec
	p := e.producer(t)
	seqs := map[string]uint64{}
	for _, k := range []string{"once", "thrice", "plain", "slow"} {
		q, err := worker.Enqueue(ctx, p, k, kindJob{k}, worker.WithKey([]byte(k)))
		if err != nil {
			t.Fatal(err)
		}
		seqs[k] = q.Seq
	}
	start(t, cfg)
	rec.waitFor(t, 40*time.Second, "every job dead-lettered", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) == 4 })

	failed := map[uint64][]worker.Event{}
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobFailed {
			failed[ev.Seq] = append(failed[ev.Seq], ev)
		}
	}
	for k, want := range map[string]int{"once": 1, "thrice": 3, "plain": 4, "slow": 2} {
		if got := len(failed[seqs[k]]); got != want {
			t.Errorf("kind %s: %d attempts, want %d", k, got, want)
		}
	}
	for i, ev := range failed[seqs["thrice"]] {
		want := time.Duration(i+1) * kindBackoff
		if i == 2 {
			want = 0 // the last attempt: dead-lettered, no wait
		}
		if ev.Backoff != want {
			t.Errorf("thrice, attempt %d: backoff %v, want the kind's %v", i+1, ev.Backoff, want)
		}
	}
	for i, ev := range failed[seqs["plain"]][:3] {
		if ev.Backoff != time.Millisecond {
			t.Errorf("plain, attempt %d: backoff %v, want the worker's 1ms", i+1, ev.Backoff)
		}
	}
	for _, ev := range failed[seqs["slow"]] {
		// Ended by a timeout before the worker's could fire: the kind's.
		if !errors.Is(ev.Err, worker.ErrHandleTimeout) || ev.Duration >= cfg.HandleTimeout {
			t.Errorf("slow: %v after %v, want the kind's timeout", ev.Err, ev.Duration)
		}
	}
}

// A kind ordered by partition waits, in a partition that runs jobs of
// different keys side by side, for every job before it to return, and no
// job after it starts before it returns.
func TestKindOrderWaitsForThePartition(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	var mu sync.Mutex
	var log []string
	note := func(s string) {
		mu.Lock()
		log = append(log, s)
		mu.Unlock()
	}
	release := make(chan struct{})
	mux := worker.NewMux()
	worker.Handle(mux, "work", func(ctx context.Context, _ *worker.Job, j kindJob) error {
		note(j.Name + " start")
		if j.Name == "a" {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		note(j.Name + " end")
		return nil
	})
	worker.Handle(mux, "barrier", func(ctx context.Context, _ *worker.Job, j kindJob) error {
		note(j.Name + " start")
		note(j.Name + " end")
		return nil
	}, worker.KindOrder(worker.OrderPartition))
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Order, cfg.PartitionConcurrency = worker.OrderKey, 4
	cfg.Observer = rec
	p := e.producer(t)
	var seqs []uint64
	for _, j := range []struct{ kind, name string }{{"work", "a"}, {"work", "d"}, {"barrier", "b"}, {"work", "c"}} {
		q, err := worker.Enqueue(ctx, p, j.kind, kindJob{j.name}, worker.WithKey([]byte(j.name)))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, q.Seq)
	}
	start(t, cfg)
	// d runs beside a (another key); once it finished, a is let go.
	rec.waitFor(t, 30*time.Second, "d finished", func() bool {
		return rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobFinished && ev.Seq == seqs[1] }) == 1
	})
	close(release)
	rec.waitFor(t, 30*time.Second, "every job finished", func() bool { return rec.count(kind(worker.EventJobFinished)) == 4 })
	mu.Lock()
	defer mu.Unlock()
	at := map[string]int{}
	for i, s := range log {
		at[s] = i
	}
	if at["b start"] < at["a end"] || at["b start"] < at["d end"] {
		t.Errorf("the barrier kind started before the jobs before it returned: %v", log)
	}
	if at["c start"] < at["b end"] {
		t.Errorf("a job after the barrier kind started before it returned: %v", log)
	}
}
