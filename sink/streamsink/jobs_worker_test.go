package streamsink_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// appliedLog records what a runner's Handler was given, by idempotency key.
type appliedLog struct {
	mu   sync.Mutex
	n    map[string]int
	keys []string
}

func (a *appliedLog) handler(_ context.Context, e sink.Effect) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n == nil {
		a.n = map[string]int{}
	}
	a.n[e.Stamp.Key]++
	a.keys = append(a.keys, e.Stamp.Key)
	return nil
}

func (a *appliedLog) snapshot() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]int, len(a.n))
	for k, v := range a.n {
		out[k] = v
	}
	return out
}

// jobWorld is a job stream of one partition, a worker running h on it, and
// a stream sink applying its effect log.
type jobWorld struct {
	js      jetstream.JetStream
	prefix  string
	applied *appliedLog
	sink    *running
	events  chan worker.Event
}

func (jw *jobWorld) WorkerEvent(_ context.Context, e worker.Event) {
	select {
	case jw.events <- e:
	default:
	}
}

func newJobWorld(t *testing.T, prefix string, maxAttempts int, h worker.HandlerFunc) *jobWorld {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	bucket := provisionJobs(t, js, prefix, 1)
	jw := &jobWorld{js: js, prefix: prefix, applied: &appliedLog{}, events: make(chan worker.Event, 1024)}
	jw.sink = start(t, js, streamsink.Config{Prefix: prefix, Handler: jw.applied.handler, MaxBackoff: 10 * time.Millisecond})
	cfg := workerConfig(js, prefix, bucket, "w1", h)
	cfg.MaxAttempts, cfg.Observer = maxAttempts, jw
	runWorker(t, cfg)
	return jw
}

// enqueue stores one job and returns its sequence.
func (jw *jobWorld) enqueue(t *testing.T, body string) uint64 {
	t.Helper()
	p := producerOf(t, jw.js, jw.prefix)
	e, err := p.Enqueue(ctxFor(t, 30*time.Second), []byte(body), []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return e.Seq
}

// await waits for a worker event of kind k for job seq.
func (jw *jobWorld) await(t *testing.T, k worker.EventKind, seq uint64) {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		select {
		case e := <-jw.events:
			if e.Kind == k && e.Seq == seq {
				return
			}
		case <-deadline:
			t.Fatalf("no %v event for job %d within a minute", k, seq)
		}
	}
}

// settle waits until the sink has handled the whole effect log.
func (jw *jobWorld) settle(t *testing.T) {
	t.Helper()
	settleLog(t, jw.js, jw.prefix, jw.sink)
}

// A job that emits effects and fails every attempt is dead-lettered: none
// of its effects are applied, while the next job's are.
func TestDeadLetteredJobAppliesNothing(t *testing.T) {
	t.Parallel()
	jw := newJobWorld(t, "dead", 2, func(ctx context.Context, j *worker.Job) error {
		for i := range 2 {
			if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-%d", j.Data, i))); err != nil {
				return err
			}
		}
		if string(j.Data) == "bad" {
			return errors.New("the order is invalid")
		}
		return nil
	})
	bad := jw.enqueue(t, "bad")
	jw.await(t, worker.EventJobDeadLettered, bad)
	good := jw.enqueue(t, "good")
	jw.await(t, worker.EventJobFinished, good)
	waitApplied(t, jw.applied, 2)
	jw.settle(t)
	got := jw.applied.snapshot()
	for k := range got {
		if k == fmt.Sprintf("dead.0.%d.0", bad) || k == fmt.Sprintf("dead.0.%d.1", bad) {
			t.Errorf("effect %s of the dead-lettered job %d was applied", k, bad)
		}
	}
	for i := range 2 {
		if k := fmt.Sprintf("dead.0.%d.%d", good, i); got[k] != 1 {
			t.Errorf("effect %s of the completed job was applied %d times, want once", k, got[k])
		}
	}
	if len(got) != 2 {
		t.Errorf("applied %v, want the completed job's two effects only", got)
	}
}

// An attempt that emits three effects and fails on the third applies none
// of them; its retry, which succeeds, applies exactly its three, once.
func TestFailedAttemptAppliesNoneRetryAppliesAll(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	attempts := map[uint64]int{}
	jw := newJobWorld(t, "third", 3, func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		attempts[j.Seq]++
		n := attempts[j.Seq]
		mu.Unlock()
		for i := range 3 {
			if err := j.Emit(ctx, []byte(fmt.Sprintf("attempt %d effect %d", n, i))); err != nil {
				return err
			}
		}
		if n == 1 {
			return errors.New("the third effect's write failed")
		}
		return nil
	})
	seq := jw.enqueue(t, "job")
	jw.await(t, worker.EventJobFinished, seq)
	waitApplied(t, jw.applied, 3)
	jw.settle(t)
	got := jw.applied.snapshot()
	for i := range 3 {
		if k := fmt.Sprintf("third.0.%d.%d", seq, i); got[k] != 1 {
			t.Errorf("effect %s applied %d times, want once", k, got[k])
		}
	}
	if len(got) != 3 {
		t.Errorf("applied %v, want three effects", got)
	}
	jw.applied.mu.Lock()
	defer jw.applied.mu.Unlock()
	if len(jw.applied.keys) != 3 {
		t.Errorf("the handler was given %d effects (%v), want 3: the failed attempt's were applied", len(jw.applied.keys), jw.applied.keys)
	}
}

// waitApplied waits until at least n distinct effects are applied.
func waitApplied(t *testing.T, a *appliedLog, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for len(a.snapshot()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("after a minute %d effects applied, want %d", len(a.snapshot()), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
