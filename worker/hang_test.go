package worker_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// syncBuffer is a log destination goroutines can share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A handler that honours its context past HandleTimeout fails the attempt,
// with a cause matching ErrHandleTimeout, whatever it returns; after
// MaxAttempts the job is dead-lettered and the partition goes on.
func TestHandleTimeoutFailsTheAttempt(t *testing.T) {
	e := newEnv(t, 1)
	enq := e.enqueue(t, 0, 2)
	var causes sync.Map
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq != enq[0].Seq {
			return nil
		}
		<-ctx.Done()
		causes.Store(j.Attempt, context.Cause(ctx))
		return nil // too late: the attempt has failed
	})
	rec := newRecorder()
	cfg := e.config("a", h)
	cfg.HandleTimeout, cfg.HangGrace, cfg.MaxAttempts, cfg.Observer = 100*time.Millisecond, 30*time.Second, 2, rec
	start(t, cfg)
	rec.waitFor(t, time.Minute, "the timed-out job to be dead-lettered and the next one to finish", func() bool {
		return rec.count(kind(worker.EventJobDeadLettered)) == 1 &&
			rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobFinished && ev.Seq == enq[1].Seq }) == 1
	})
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobFailed && !errors.Is(ev.Err, worker.ErrHandleTimeout) {
			t.Errorf("failed attempt %d: %v, want a handle timeout", ev.Attempt, ev.Err)
		}
	}
	if c, _ := causes.Load(1); !errors.Is(c.(error), worker.ErrHandleTimeout) {
		t.Fatalf("the handler's context ended with cause %v", c)
	}
	if n := rec.count(kind(worker.EventJobHung)); n != 0 {
		t.Fatalf("%d hangs reported for a handler that returned", n)
	}
}

// A handler that ignores its context does not hold its partition for good:
// HangGrace after HandleTimeout the worker reports the hang (event, metric,
// a WARN line naming the job), refuses the job's further emits and releases
// the partition; taken again, the job counts its hangs on towards
// MaxAttempts and is dead-lettered, and the partition goes on.
func TestHungHandlerGivesThePartitionUp(t *testing.T) {
	e := newEnv(t, 1)
	enq := e.enqueue(t, 0, 2)
	hung := enq[0].Seq
	unblock := make(chan struct{})
	late := make(chan error, 4) // what the hung handlers' late emits got
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq != hung {
			return j.Emit(ctx, []byte("ok"))
		}
		<-unblock // deaf to ctx
		late <- j.Emit(context.Background(), []byte("late"))
		return nil
	})
	rec := newRecorder()
	logs := &syncBuffer{}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	cfg := e.config("a", h)
	cfg.HandleTimeout, cfg.HangGrace, cfg.MaxAttempts, cfg.Observer = 200*time.Millisecond, 200*time.Millisecond, 2, rec
	cfg.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cfg.Telemetry = telemetry.Config{MeterProvider: mp}
	r := start(t, cfg)

	rec.waitFor(t, 2*time.Minute, "two hangs, the dead letter, and the next job finished", func() bool {
		return rec.count(kind(worker.EventJobHung)) == 2 && rec.count(kind(worker.EventJobDeadLettered)) == 1 &&
			rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobFinished && ev.Seq == enq[1].Seq }) == 1
	})
	// Each hang gave the partition up: it was acquired anew, under a new
	// epoch, after each.
	var epochs []uint64
	for _, ev := range rec.all() {
		switch ev.Kind {
		case worker.EventPartitionAcquired:
			epochs = append(epochs, uint64(ev.Lease.Epoch))
		case worker.EventJobHung:
			if ev.Seq != hung || !errors.Is(ev.Err, worker.ErrHandlerHung) {
				t.Errorf("hang event: seq %d, %v", ev.Seq, ev.Err)
			}
		case worker.EventJobDeadLettered:
			if !errors.Is(ev.Err, worker.ErrHandlerHung) {
				t.Errorf("dead-lettered for %v, want the hang", ev.Err)
			}
		}
	}
	if len(epochs) < 3 || epochs[1] <= epochs[0] || epochs[2] <= epochs[1] {
		t.Fatalf("acquisitions under epochs %v: want one after each hang", epochs)
	}
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 || dlq[0].Headers().Get(worker.HeaderSeq) != fmt.Sprint(hung) || dlq[0].Headers().Get(worker.HeaderAttempts) != "2" ||
		!strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "did not return") {
		t.Fatalf("dead letters: %d, %v", len(dlq), dlq)
	}
	if out := logs.String(); strings.Count(out, "handler hung") != 2 || !strings.Contains(out, fmt.Sprintf("partition=0 epoch=%d seq=%d", epochs[0], hung)) {
		t.Fatalf("log:\n%s", out)
	} else if strings.Contains(out, "drain ran out of time") {
		t.Fatalf("no drain was asked, and the log says one ran out of time:\n%s", out)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	if n := counterValue(rm, "leasehold.jobs.hung"); n != 2 {
		t.Fatalf("leasehold.jobs.hung = %d, want 2", n)
	}

	// The hung handlers wake: what they emit now is refused, and Stop
	// does not wait for them.
	close(unblock)
	for range 2 {
		select {
		case err := <-late:
			if !errors.Is(err, worker.ErrJobDone) {
				t.Errorf("a hung handler's late emit: %v, want ErrJobDone", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("gave up waiting for the hung handlers to return after they were unblocked")
		}
	}
	r.stop(t)
}

func counterValue(rm metricdata.ResourceMetrics, name string) int64 {
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if s, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == name {
				for _, p := range s.DataPoints {
					n += p.Value
				}
			}
		}
	}
	return n
}
