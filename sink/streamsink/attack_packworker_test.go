package streamsink_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// A packing worker's own effect whose headers are large: 62000 bytes,
// which an effect sent alone may carry, and 70000, which no stream takes
// in a message's headers (64 KiB) but a pack carries in its body. A job
// the worker commits must have both its effects applied, once: either the
// worker refuses the effect when it is emitted (it does, past 64 KiB less
// room for the stamp and a sink's headers: the job fails and goes to its
// dead-letter stream), or the sink with a Handler applies it. (A sink that
// refused such a pack whole, as streamsink did for a while, lost the jobs
// of workers that packed it.) Closed.
func TestAttackPackWorkerLargeHeaderEffect(t *testing.T) {
	t.Parallel()
	for _, size := range []int{62000, 70000} {
		t.Run(strconv.Itoa(size), func(t *testing.T) { largeHeaderEffect(t, "atkpkhdr"+strconv.Itoa(size), size) })
	}
}

func largeHeaderEffect(t *testing.T, prefix string, size int) {
	js, _ := startTopo(t, "single")
	bucket := provisionJobs(t, js, prefix, 1)
	var mu sync.Mutex
	applied := map[string]int{}
	dec := &decisionList{}
	r := start(t, js, streamsink.Config{Prefix: prefix, Verifier: bucket, MaxBackoff: 10 * time.Millisecond, Observer: dec,
		Handler: func(_ context.Context, e sink.Effect) error {
			mu.Lock()
			applied[e.Stamp.Key]++
			mu.Unlock()
			return nil
		}})
	events := make(chan worker.Event, 4096)
	cfg := workerConfig(js, prefix, bucket, "w1", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if err := j.Emit(ctx, []byte("small")); err != nil {
			return err
		}
		h := nats.Header{}
		h.Set("X-Large", strings.Repeat("h", size))
		return j.Emit(ctx, []byte("large"), worker.EmitHeader(h))
	}))
	cfg.PackEffects = true
	cfg.StampFormat = leasehold.StampCompact
	cfg.MaxAttempts = 1
	cfg.Observer = forwardEvents(events)
	runWorker(t, cfg)
	seq := enqueueJobs(t, ctxFor(t, 10*time.Second), js, prefix, 1)[0]
	ctx := ctxFor(t, time.Minute)
	for {
		select {
		case e := <-events:
			switch {
			case e.Kind == worker.EventJobDeadLettered && e.Seq == seq:
				return // refused at the worker: not committed as done, nothing lost
			case e.Kind == worker.EventJobFinished && e.Seq == seq:
				awaitCommitted(t, ctx, events, seq)
				settleLog(t, js, prefix, r)
				mu.Lock()
				defer mu.Unlock()
				for i := range 2 {
					if k := leasehold.EffectKey(prefix, 0, seq, i); applied[k] != 1 {
						t.Errorf("the worker committed job %d; its effect %s was applied %d times; decisions %v", seq, k, applied[k], dec.all())
					}
				}
				return
			}
		case <-ctx.Done():
			t.Fatal("the job neither finished nor was dead-lettered")
		}
	}
}

// decisionList records every decision reported.
type decisionList struct {
	mu sync.Mutex
	ds []sink.Decision
}

func (l *decisionList) Decided(_ context.Context, d sink.Decision) {
	l.mu.Lock()
	l.ds = append(l.ds, d)
	l.mu.Unlock()
}

func (l *decisionList) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, d := range l.ds {
		s := d.Stamp.Key + " " + d.Outcome.String()
		if d.Err != nil {
			s += ": " + d.Err.Error()
		}
		out = append(out, s)
	}
	return out
}
