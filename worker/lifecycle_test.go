package worker_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// Graceful hand-off: B joins and takes half of A's partitions, then A shuts
// down and B takes the rest. Every hand-off drains and commits first, so no
// job runs twice, and each successor starts exactly where its predecessor
// committed.
func TestGracefulHandOff(t *testing.T) {
	const n = 4
	e := newEnv(t, n)
	var runs runLog
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		time.Sleep(time.Millisecond) // keep jobs in flight across hand-offs
		return j.Emit(ctx, j.Data)
	})
	cfg := func(name string) worker.Config {
		c := e.config(name, h)
		c.Coordinator.TTL = 10 * time.Second // a hand-off that waited for expiry would show
		c.Observer = rec
		return c
	}
	a := start(t, cfg("a"))
	e.enqueue(t, 0, 400)
	rec.waitFor(t, 30*time.Second, "A to start", func() bool { return runs.n.Load() > 50 })
	b := start(t, cfg("b"))
	rec.waitFor(t, 30*time.Second, "B to take half", func() bool { return len(b.w.Held()) == n/2 })
	enq := e.enqueue(t, 400, 400)
	if err := a.w.Stop(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := a.w.Stop(ctxFor(t, time.Second)); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	rec.waitFor(t, 30*time.Second, "B to run every job", func() bool { return len(distinct(runs.all())) == 800 })
	b.stop(t)
	a.stop(t)

	if n := rec.count(kind(worker.EventPartitionLost)); n != 0 {
		t.Fatalf("%d leases lost during graceful hand-offs", n)
	}
	for k, c := range distinct(runs.all()) {
		if c != 1 {
			t.Errorf("job %v ran %d times", k, c)
		}
	}
	// Each of A's drains committed the progress its successor started at.
	drained := map[leasehold.Partition]uint64{}
	for _, ev := range rec.all() {
		switch {
		case ev.Kind == worker.EventPartitionDrained && ev.Lease.Holder == "a":
			drained[ev.Lease.Partition] = ev.Seq
		case ev.Kind == worker.EventPartitionAcquired && ev.Lease.Holder == "b":
			want, ok := drained[ev.Lease.Partition]
			if !ok {
				t.Fatalf("B acquired partition %d before A drained it", ev.Lease.Partition)
			}
			if ev.Seq != want {
				t.Errorf("partition %d: B started after %d, A committed %d", ev.Lease.Partition, ev.Seq, want)
			}
		}
	}
	if len(drained) != n {
		t.Fatalf("A drained %d partitions, want %d", len(drained), n)
	}
	_ = enq
}

func distinct(runs []handled) map[[2]uint64]int {
	m := map[[2]uint64]int{}
	for _, r := range runs {
		m[[2]uint64{uint64(r.P), r.Seq}]++
	}
	return m
}

// Stop is safe before Run, twice, and from several goroutines; Run after
// Stop says what to do instead.
func TestStopIsSafe(t *testing.T) {
	e := newEnv(t, 1)
	w, err := worker.New(e.config("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil })))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Stop(ctxFor(t, time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := w.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "create a new Worker") {
		t.Fatalf("Run after Stop: %v", err)
	}

	rec := newRecorder()
	cfg := e.config("w2", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.Observer = rec
	r := start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the worker to run", func() bool { return rec.count(kind(worker.EventPartitionReady)) > 0 })
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.w.Stop(context.Background()); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	<-r.w.Stopped()
	if err := r.w.Run(context.Background()); err == nil {
		t.Fatal("a second Run succeeded")
	}
}

// A configuration with many mistakes is refused with all of them named.
func TestConfigErrorsSayWhatToFix(t *testing.T) {
	_, err := worker.New(worker.Config{
		Prefix:      "bad.prefix",
		Partitions:  0,
		MaxAttempts: -1,
		Coordinator: coordinator.Config{OnAcquire: func(*coordinator.Lease) {}},
	})
	if err == nil {
		t.Fatal("New accepted an empty config")
	}
	for _, want := range []string{"JetStream is nil", "prefix \"bad.prefix\"", "partitions 0", "Handler is nil", "no lease bucket", "OnAcquire", "max attempts -1"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// A worker configured with another partition count than the stream's is
// refused when it starts.
func TestPartitionCountMismatchIsRefused(t *testing.T) {
	e := newEnv(t, 4)
	cfg := e.config("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.Partitions = 8
	w, err := worker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = w.Run(ctxFor(t, 10*time.Second))
	if !errors.Is(err, worker.ErrStreamConfig) || !strings.Contains(err.Error(), "has 4 partitions and this is configured with 8") {
		t.Fatalf("Run: %v", err)
	}
}
