package worker_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/worker"
)

// Middleware wraps the handler with the first one outermost, and sees the
// job in its context.
func TestMiddlewareOrderAndJobFromContext(t *testing.T) {
	e := newEnv(t, 1)
	e.enqueue(t, 0, 1)
	var mu sync.Mutex
	var trail []string
	note := func(s string) {
		mu.Lock()
		trail = append(trail, s)
		mu.Unlock()
	}
	mw := func(name string) worker.Middleware {
		return func(next worker.Handler) worker.Handler {
			return worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
				if worker.JobFromContext(ctx) != j {
					t.Errorf("%s: JobFromContext is not the job", name)
				}
				note(name + ">")
				err := next.Handle(ctx, j)
				note("<" + name)
				return err
			})
		}
	}
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		note("handler")
		return nil
	}))
	cfg.Middleware = []worker.Middleware{mw("outer"), mw("inner")}
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the job", func() bool { return rec.count(kind(worker.EventJobFinished)) == 1 })
	mu.Lock()
	defer mu.Unlock()
	if got := strings.Join(trail, " "); got != "outer> inner> handler <inner <outer" {
		t.Fatalf("ran %s", got)
	}
	if worker.JobFromContext(context.Background()) != nil {
		t.Fatal("JobFromContext found a job in a bare context")
	}
}

// MaxConcurrency bounds the handlers running at once beyond one per held
// partition: each partition's first is its own, and every further one
// takes a slot of the worker's pool.
func TestMaxConcurrency(t *testing.T) {
	e := newEnv(t, 4)
	e.enqueue(t, 0, 200)
	var running, peak atomic.Int64
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		n := running.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		time.Sleep(2 * time.Millisecond)
		running.Add(-1)
		return nil
	}))
	cfg.PartitionConcurrency = 8
	cfg.MaxConcurrency = 2
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "every job", func() bool { return rec.count(kind(worker.EventJobFinished)) == 200 })
	if p := peak.Load(); p > 4+2 {
		t.Fatalf("%d handlers ran at once; the bound is one per partition (4) and 2 more", p)
	}
}

// A partition always may run one job, however many jobs of other
// partitions hold the pool: here partition 0's jobs hang on to the one
// pool slot and their own, and the other partitions still run every job.
func TestEveryPartitionRunsWhenThePoolIsTaken(t *testing.T) {
	e := newEnv(t, 4)
	release := make(chan struct{})
	var blocked atomic.Int64
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Partition == 0 {
			blocked.Add(1)
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}))
	cfg.PartitionConcurrency = 8
	cfg.MaxConcurrency = 1
	cfg.Observer = rec
	start(t, cfg)
	t.Cleanup(func() { close(release) }) // before the worker stops
	enq := e.enqueue(t, 0, 200)
	others := 0
	for _, q := range enq {
		if q.Partition != 0 {
			others++
		}
	}
	rec.waitFor(t, 30*time.Second, "every job of the other partitions", func() bool {
		return rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobFinished && ev.Lease.Partition != 0 }) == others
	})
	rec.waitFor(t, 30*time.Second, "partition 0 to run two jobs", func() bool { return blocked.Load() == 2 })
	if n := blocked.Load(); n > 2 {
		t.Fatalf("partition 0 runs %d jobs at once: its own slot and the pool's one, at most", n)
	}
}

// Trace context travels from the enqueuing context through the job to the
// handler's context and into every effect; a lowercase traceparent written
// by another client is read too.
func TestTraceContextFlows(t *testing.T) {
	e := newEnv(t, 1)
	prop := propagation.TraceContext{}
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	ctx := trace.ContextWithRemoteSpanContext(ctxFor(t, 30*time.Second), sc)
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: 1, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("traced")); err != nil {
		t.Fatal(err)
	}
	raw := &nats.Msg{Subject: worker.JobSubject(e.prefix, 0), Data: []byte("lowercase"), Header: nats.Header{
		"traceparent": []string{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	}}
	if _, err := e.js.PublishMsg(ctx, raw); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string]trace.TraceID{}
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		seen[string(j.Data)] = trace.SpanContextFromContext(ctx).TraceID()
		mu.Unlock()
		return j.Emit(ctx, j.Data)
	}))
	cfg.Propagator = prop
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "both jobs", func() bool { return rec.count(kind(worker.EventJobFinished)) == 2 })
	mu.Lock()
	for job, got := range seen {
		if got != tid {
			t.Errorf("job %q ran with trace %v, want %v", job, got, tid)
		}
	}
	mu.Unlock()
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		if isBarrier(m) {
			continue
		}
		if tp := m.Headers().Get("traceparent"); !strings.Contains(tp, tid.String()) {
			t.Errorf("effect %q carries traceparent %q", m.Data(), tp)
		}
	}
}

// With TrimCommitted, a partition's jobs up to its committed progress are
// purged from the job stream.
func TestTrimCommitted(t *testing.T) {
	e := newEnv(t, 2)
	enq := e.enqueue(t, 0, 100)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.TrimCommitted = true
	cfg.Observer = rec
	r := start(t, cfg)
	last := map[leasehold.Partition]uint64{}
	for _, q := range enq {
		last[q.Partition] = max(last[q.Partition], q.Seq)
	}
	rec.waitFor(t, 30*time.Second, "progress through the last job of each partition", func() bool {
		done := map[leasehold.Partition]bool{}
		for _, ev := range rec.all() {
			if ev.Kind == worker.EventProgressCommitted && ev.Seq == last[ev.Lease.Partition] {
				done[ev.Lease.Partition] = true
			}
		}
		return len(done) == len(last)
	})
	r.stop(t)
	s, err := e.js.Stream(ctxFor(t, 10*time.Second), worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctxFor(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 0 {
		t.Fatalf("%d jobs left after every job was committed", info.State.Msgs)
	}
}

// A lease bucket serves one job stream: a worker of another is refused.
func TestBucketServesOneJobStream(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the first worker", func() bool { return rec.count(kind(worker.EventPartitionReady)) == 1 })
	if err := worker.ProvisionJobs(ctxFor(t, 10*time.Second), e.js, worker.JobsConfig{Prefix: "other", Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	cfg = e.config("x", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.Prefix = "other"
	w, err := worker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = w.Run(ctxFor(t, 10*time.Second))
	if !errors.Is(err, worker.ErrStreamConfig) || !strings.Contains(err.Error(), `serves job stream "jobs", not "other"`) {
		t.Fatalf("Run on another stream's bucket: %v", err)
	}
}

// Fences are advanced to the lease's epoch before the first job, effects
// applied through a sink carry the lease's stamp, and once a successor has
// fenced the sink, a write stamped by the former holder is refused.
func TestFencesAndApply(t *testing.T) {
	e := newEnv(t, 1)
	enq := e.enqueue(t, 0, 3)
	mem := sink.NewMemory(sink.MemoryConfig{Logger: testLogger()})
	var maxAtFirst atomic.Uint64
	var oldStamp atomic.Value
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq == enq[0].Seq {
			f, _ := mem.Fence(ctx, j.Lease.Fence())
			maxAtFirst.Store(uint64(f.Epoch))
			s, _ := j.NextStamp()
			oldStamp.Store(s)
		}
		return j.Apply(ctx, mem, string(j.Data), j.Data)
	})
	cfg := e.config("a", h)
	cfg.Fences = []worker.Fence{mem}
	cfg.Observer = rec
	a := start(t, cfg)
	rec.waitFor(t, 30*time.Second, "A's jobs", func() bool { return rec.count(kind(worker.EventJobFinished)) == 3 })
	a.stop(t)
	epochA := rec.all()[0].Lease.Epoch
	if got := leasehold.Epoch(maxAtFirst.Load()); got != epochA {
		t.Fatalf("the sink's max at the first job was %d, want the lease's epoch %d", got, epochA)
	}
	eff, ok := mem.Get("key-1")
	if !ok || eff.Stamp.Epoch != epochA || eff.Stamp.Key != leasehold.EffectKey(e.prefix, 0, enq[1].Seq, 0) {
		t.Fatalf("applied effect %+v", eff)
	}

	cfg = e.config("b", h)
	cfg.Fences = []worker.Fence{mem}
	rec2 := newRecorder()
	cfg.Observer = rec2
	start(t, cfg)
	rec2.waitFor(t, 30*time.Second, "B to take over", func() bool { return rec2.count(kind(worker.EventPartitionReady)) == 1 })
	stale := sink.Effect{Stamp: oldStamp.Load().(leasehold.Stamp), Subject: "late", Data: []byte("zombie")}
	err := mem.Apply(ctxFor(t, 5*time.Second), stale)
	var se *leasehold.StaleEpochError
	if !errors.As(err, &se) || se.Epoch != epochA || se.Max <= epochA {
		t.Fatalf("A's late write: %v, want a stale-epoch refusal", err)
	}
}
