package telemetry_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// The zombie these tests trace. Worker A handles a job under epoch eA,
// stamps a write, sends an effect and pauses; its connection is frozen
// meanwhile, so the effect waits in flight, as it would in the socket
// buffers of a paused or partitioned process. A's lease expires and worker
// B takes the partition over at eB > eA: it advances the memory and KV
// sinks and publishes a barrier into the effect log before it handles the
// job again. Then A resumes, unaware: its effect reaches the log behind B's
// barrier, where the stream runner refuses it, and it writes its stamped
// effect to the memory and KV sinks, which refuse it too. Three refused
// writes, one trace.

const (
	zombiePrefix = "zz"
	zombieA      = "worker-a"
	zombieB      = "worker-b"
)

type zombieRun struct {
	traceID        trace.TraceID // the enqueue's trace, which every span of the story joins
	epochA, epochB leasehold.Epoch
	mem            *sink.Memory
	kvA            *kvsink.Sink
	runner         *streamsink.Runner
}

func ctxFor(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// events collects worker events and lets the test wait for one.
type events struct {
	mu   sync.Mutex
	seen []worker.Event
	ch   chan struct{}
}

func newEvents() *events { return &events{ch: make(chan struct{}, 1)} }

func (e *events) WorkerEvent(_ context.Context, ev worker.Event) {
	e.mu.Lock()
	e.seen = append(e.seen, ev)
	e.mu.Unlock()
	select {
	case e.ch <- struct{}{}:
	default:
	}
}

func (e *events) wait(t *testing.T, what string, k worker.EventKind) worker.Event {
	t.Helper()
	return e.waitFor(t, what, func(ev worker.Event) bool { return ev.Kind == k })
}

// waitFor waits for the first event that matches.
func (e *events) waitFor(t *testing.T, what string, match func(worker.Event) bool) worker.Event {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		e.mu.Lock()
		for _, ev := range e.seen {
			if match(ev) {
				e.mu.Unlock()
				return ev
			}
		}
		e.mu.Unlock()
		select {
		case <-e.ch:
		case <-deadline:
			t.Fatalf("no %s within a minute", what)
		}
	}
}

// runZombie drives the story with every component recording through tc,
// and returns once the three refusals are reported and every worker and
// the runner have stopped.
func runZombie(t *testing.T, tc telemetry.Config) zombieRun {
	t.Helper()
	ctx := ctxFor(t, 3*time.Minute)
	srv := natstest.Start(t, natstest.Listen())
	js := srv.JetStream(t)
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: zombiePrefix + "-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: zombiePrefix, Partitions: 1}); err != nil {
		t.Fatal(err)
	}

	// A reaches NATS through a proxy the test can freeze.
	px := natstest.NewProxy(t, srv.URL())
	ncA, err := nats.Connect(px.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ncA.Close)
	jsA, err := jetstream.New(ncA)
	if err != nil {
		t.Fatal(err)
	}
	bucketA, err := coordinator.OpenBucket(ctx, jsA, zombiePrefix+"-leases")
	if err != nil {
		t.Fatal(err)
	}

	run := zombieRun{mem: sink.NewMemory(sink.MemoryConfig{Logger: quiet(), Telemetry: tc})}
	// One KV bucket, written by each worker through a sink of its own.
	if run.kvA, err = kvsink.New(ctx, jsA, kvsink.Config{Bucket: "zz-kv", Logger: quiet(), Telemetry: tc}); err != nil {
		t.Fatal(err)
	}
	kvB, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "zz-kv", Logger: quiet(), Telemetry: tc})
	if err != nil {
		t.Fatal(err)
	}
	refused := make(chan sink.Decision, 1)
	if run.runner, err = streamsink.New(ctx, js, streamsink.Config{
		Prefix: zombiePrefix, Logger: quiet(), Telemetry: tc,
		Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
			if d.Outcome == sink.Stale {
				refused <- d
			}
		}),
	}); err != nil {
		t.Fatal(err)
	}
	rctx, stopRunner := context.WithCancel(context.Background())
	runnerDone := make(chan error, 1)
	go func() { runnerDone <- run.runner.Run(rctx) }()
	defer func() {
		stopRunner()
		if err := <-runnerDone; err != nil {
			t.Errorf("runner: %v", err)
		}
	}()

	var (
		blocked    = make(chan struct{})
		resume     = make(chan struct{})
		zombieDone = make(chan [2]error, 1)
		jobEpoch   leasehold.Epoch // A's epoch for the job, set before blocked closes
	)
	evA := newEvents()
	// A's lease is the one the story needs to expire: a short TTL, so that
	// the wait for its loss is short.
	a := startWorker(t, worker.Config{
		JetStream: jsA, Bucket: bucketA, Prefix: zombiePrefix, Partitions: 1,
		Coordinator: coordinator.Config{Worker: zombieA, TTL: time.Second, Margin: 100 * time.Millisecond},
		Fences:      []worker.Fence{run.mem, run.kvA},
		CommitEvery: time.Hour, // A commits nothing before its pause
		Observer:    evA, Logger: quiet(), Telemetry: tc,
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			stamp, err := j.NextStamp() // for the direct writes below
			if err != nil {
				return err
			}
			px.Freeze()
			// The SDK holds a job's last effect on a subject back until
			// the handler returns: of two, the first goes out now (and
			// waits in the frozen connection), the second never does.
			for range 2 {
				if err := j.Emit(ctx, j.Data); err != nil {
					return err
				}
			}
			jobEpoch = j.Lease.Epoch
			close(blocked)
			<-resume
			// The pause hides the loss from the handler: it writes as if
			// its context were live.
			wctx := context.WithoutCancel(ctx)
			e := sink.Effect{Stamp: stamp, Subject: "zombie", Data: j.Data}
			errs := [2]error{run.mem.Apply(wctx, e), run.kvA.Apply(wctx, e)}
			zombieDone <- errs
			return errors.Join(errs[:]...)
		}),
	})

	tracer := tc.TracerProvider.Tracer("zombie-test")
	rootCtx, root := tracer.Start(ctx, "zombie demo")
	run.traceID = root.SpanContext().TraceID()
	prod, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: zombiePrefix, Partitions: 1, Telemetry: tc})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := prod.EnqueueTo(rootCtx, 0, []byte("job-1")); err != nil {
		t.Fatal(err)
	}
	root.End()

	select {
	case <-blocked:
	case <-time.After(time.Minute):
		t.Fatal("A never started the job")
	}
	// The loss of the lease A runs the job under: with a 1s TTL, a stall
	// on a busy machine can cost A an earlier lease before the job starts,
	// and the first loss reported would then be of another epoch.
	run.epochA = evA.waitFor(t, "loss of A's lease", func(ev worker.Event) bool {
		return ev.Kind == worker.EventPartitionLost && ev.Lease.Epoch == jobEpoch
	}).Lease.Epoch

	evB := newEvents()
	// B's lease must last until the end of the story: should B lose it to
	// a stall and take the partition again, the sinks would refuse A under
	// an epoch above the one B's job ran at. Nothing waits for B's lease
	// to expire (B releases it when it stops), so a 10s TTL costs no time.
	b := startWorker(t, worker.Config{
		JetStream: js, Bucket: bucket, Prefix: zombiePrefix, Partitions: 1,
		Coordinator: coordinator.Config{Worker: zombieB, TTL: 10 * time.Second},
		Fences:      []worker.Fence{run.mem, kvB},
		Observer:    evB, Logger: quiet(), Telemetry: tc,
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			if err := j.Emit(ctx, j.Data); err != nil {
				return err
			}
			if err := j.Apply(ctx, run.mem, "job", j.Data); err != nil {
				return err
			}
			return j.Apply(ctx, kvB, "job", j.Data)
		}),
	})
	run.epochB = evB.wait(t, "B's job", worker.EventJobFinished).Lease.Epoch

	px.Thaw()
	close(resume)
	var errs [2]error
	select {
	case errs = <-zombieDone:
	case <-time.After(time.Minute):
		t.Fatal("A's handler did not resume")
	}
	for i, name := range []string{"memory", "kv"} {
		var se *leasehold.StaleEpochError
		if !errors.As(errs[i], &se) || se.Epoch != run.epochA || se.Max != run.epochB {
			t.Fatalf("the %s sink answered A's write with %v, want a refusal of epoch %d under %d", name, errs[i], run.epochA, run.epochB)
		}
	}
	select {
	case d := <-refused:
		if d.Stamp.Worker != zombieA || d.Holder != zombieB {
			t.Fatalf("the runner refused %+v, want A's effect under B", d)
		}
	case <-time.After(time.Minute):
		t.Fatal("the stream runner never refused A's effect")
	}
	a.stop(t)
	b.stop(t)
	return run
}

// running is a worker whose Run runs in a goroutine until stopped.
type running struct {
	w    *worker.Worker
	stop func(t *testing.T)
}

func startWorker(t *testing.T, cfg worker.Config) *running {
	t.Helper()
	w, err := worker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	r := &running{w: w}
	r.stop = func(t *testing.T) {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("worker %s: %v", w.ID(), err)
				}
			case <-time.After(time.Minute):
				t.Errorf("worker %s did not stop", w.ID())
			}
		})
	}
	t.Cleanup(func() { r.stop(t) })
	return r
}
