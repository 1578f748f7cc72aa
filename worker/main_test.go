package worker_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// testLogger is quiet unless LEASEHOLD_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("LEASEHOLD_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func ctxFor(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// env is one embedded server with a lease bucket and a provisioned job
// stream.
type env struct {
	srv    *natstest.Server
	js     jetstream.JetStream
	bucket *coordinator.Bucket
	prefix string
	n      int
}

func newEnv(t testing.TB, n int, opts ...natstest.Option) *env {
	t.Helper()
	srv := natstest.Start(t, opts...)
	e := &env{srv: srv, prefix: "jobs", n: n}
	e.js = srv.JetStream(t)
	e.bucket = e.provision(t, e.js)
	return e
}

func (e *env) provision(t testing.TB, js jetstream.JetStream) *coordinator.Bucket {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: e.prefix, Partitions: e.n, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	return e.provisionBucket(t)
}

// provisionBucket creates the env's lease bucket, "<prefix>-leases".
func (e *env) provisionBucket(t testing.TB) *coordinator.Bucket {
	t.Helper()
	b, err := coordinator.Provision(ctxFor(t, 30*time.Second), e.js, coordinator.BucketConfig{Bucket: e.prefix + "-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func natstestStart(t testing.TB) *natstest.Server { return natstest.Start(t) }

func (e *env) producer(t testing.TB) *worker.Producer {
	t.Helper()
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// enqueue stores count jobs with keys key-<from>, key-<from+1>, ... and
// bodies equal to the keys, and returns where each went.
func (e *env) enqueue(t testing.TB, from, count int) []worker.Enqueued {
	t.Helper()
	out, err := e.tryEnqueue(from, count)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryEnqueue is enqueue for goroutines other than the test's.
func (e *env) tryEnqueue(from, count int) ([]worker.Enqueued, error) {
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := p.Batch()
	var out []worker.Enqueued
	for i := from; i < from+count; i++ {
		key := fmt.Sprintf("key-%d", i)
		if err := b.Enqueue(ctx, []byte(key), []byte(key)); err != nil {
			return out, err
		}
		if b.Len() == 1000 || i == from+count-1 {
			res, err := b.Wait(ctx)
			out = append(out, res...)
			if err != nil {
				return out, err
			}
		}
	}
	return out, nil
}

func (e *env) config(name string, h worker.Handler) worker.Config {
	return worker.Config{
		JetStream:            e.js,
		Prefix:               e.prefix,
		Partitions:           e.n,
		Handler:              h,
		Bucket:               e.bucket,
		Coordinator:          coordinator.Config{Worker: name, TTL: 2 * time.Second, RebalanceDelay: 100 * time.Millisecond},
		Backoff:              func(int) time.Duration { return 10 * time.Millisecond },
		Logger:               testLogger().With("test", name),
		PartitionConcurrency: testPartitionConcurrency,
	}
}

// testPartitionConcurrency is the workers' PartitionConcurrency, unless a
// test sets its own: the default (0), or LEASEHOLD_TEST_PARTITION_CONCURRENCY
// (1 runs every test with one job of a partition at a time, as leasehold did
// before).
var testPartitionConcurrency = func() int {
	n, _ := strconv.Atoi(os.Getenv("LEASEHOLD_TEST_PARTITION_CONCURRENCY"))
	return n
}()

// running is a worker whose Run runs in a goroutine until the test ends.
type running struct {
	w      *worker.Worker
	cancel context.CancelFunc
	done   chan error
}

func start(t testing.TB, cfg worker.Config) *running {
	t.Helper()
	w, err := worker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{w: w, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- w.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop shuts the worker down and waits for Run; it is safe to call twice.
func (r *running) stop(t testing.TB) {
	t.Helper()
	r.cancel()
	select {
	case err, ok := <-r.done:
		if ok && err != nil {
			t.Errorf("Run: %v", err)
		}
		if ok {
			close(r.done)
		}
	case <-time.After(time.Minute):
		t.Error("Run did not return within a minute of its context ending")
	}
}

// recorder collects worker events and lets tests wait on them.
type recorder struct {
	mu     sync.Mutex
	events []worker.Event
	notify chan struct{}
}

func newRecorder() *recorder { return &recorder{notify: make(chan struct{})} }

func (r *recorder) WorkerEvent(_ context.Context, e worker.Event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	close(r.notify)
	r.notify = make(chan struct{})
	r.mu.Unlock()
}

// count counts the events that match.
func (r *recorder) count(match func(worker.Event) bool) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.events {
		if match(e) {
			n++
		}
	}
	return n
}

func (r *recorder) all() []worker.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]worker.Event(nil), r.events...)
}

// waitFor waits until cond holds, re-checking after events (at most every
// 10ms, since conditions may be costly and events come by the thousand).
func (r *recorder) waitFor(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		ch := r.notify
		r.mu.Unlock()
		if cond() {
			return
		}
		select {
		case <-ch:
			time.Sleep(10 * time.Millisecond)
		case <-time.After(100 * time.Millisecond):
		case <-deadline.C:
			t.Fatalf("after %v still waiting for %s", within, what)
		}
	}
}

func kind(k worker.EventKind) func(worker.Event) bool {
	return func(e worker.Event) bool { return e.Kind == k }
}

// handled records which job ran under which lease.
type handled struct {
	Worker  string
	P       leasehold.Partition
	Seq     uint64
	Epoch   leasehold.Epoch
	Attempt int
	Data    string
}

type runLog struct {
	mu   sync.Mutex
	runs []handled
	n    atomic.Int64
}

func (l *runLog) add(j *worker.Job) {
	l.mu.Lock()
	l.runs = append(l.runs, handled{j.Lease.Holder, j.Partition, j.Seq, j.Lease.Epoch, j.Attempt, string(j.Data)})
	l.mu.Unlock()
	l.n.Add(1)
}

func (l *runLog) all() []handled {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]handled(nil), l.runs...)
}

// readStream reads every message of a stream.
func readStream(t testing.TB, js jetstream.JetStream, stream string) []jetstream.Msg {
	t.Helper()
	out, err := tryReadStream(js, stream)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryReadStream is readStream for conditions that may run while the
// server is failing over.
func tryReadStream(js jetstream.JetStream, stream string) ([]jetstream.Msg, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	want := info.State.Msgs
	if want == 0 {
		return nil, nil
	}
	c, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, err
	}
	out := make([]jetstream.Msg, 0, want)
	for uint64(len(out)) < want {
		batch, err := c.Fetch(int(min(want-uint64(len(out)), 1000)), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, err
		}
		for m := range batch.Messages() {
			out = append(out, m)
		}
		if err := batch.Error(); err != nil {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("read %d of %d messages of %s", len(out), want, stream)
		}
	}
	return out, nil
}

func stampOf(t testing.TB, m jetstream.Msg) leasehold.Stamp {
	t.Helper()
	s, err := leasehold.StampFromHeader(m.Headers())
	if err != nil {
		t.Fatalf("message on %s: %v", m.Subject(), err)
	}
	return s
}

func isBarrier(m jetstream.Msg) bool { return m.Headers().Get(leasehold.HeaderBarrier) == "1" }

func natstestListen() []natstest.Option { return []natstest.Option{natstest.Listen()} }
