package worker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// proxied connects to e's server through a proxy that the test freezes
// and thaws, as a paused process or a cut network would, reconnecting
// without end when the proxy lets it. It returns the proxy, the
// connection, its JetStream and e's lease bucket opened over it: what a
// worker that is to be frozen runs on.
func (e *env) proxied(t testing.TB) (*natstest.Proxy, *nats.Conn, jetstream.JetStream, *coordinator.Bucket) {
	t.Helper()
	px := natstest.NewProxy(t, e.srv.URL())
	nc, err := nats.Connect(px.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	bucket, err := coordinator.OpenBucket(ctxFor(t, 10*time.Second), js, e.bucket.Name())
	if err != nil {
		t.Fatal(err)
	}
	return px, nc, js, bucket
}

// runSink runs a stream sink runner on e's effect log until the test
// ends. cfg's Prefix is e's; MaxBackoff and Logger, when not set, are
// 10ms and the test logger.
func runSink(t testing.TB, e *env, cfg streamsink.Config) *streamsink.Runner {
	t.Helper()
	cfg.Prefix = e.prefix
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 10 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger().With("test", "sink")
	}
	r, err := streamsink.New(ctxFor(t, time.Minute), e.js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("sink Run: %v", err)
		}
	})
	return r
}

// freedUniqueness learns the name under which uniqueness key "nightly"
// of period is kept in e's uniqueness bucket, from a job of its own, then
// purges it, so that the test puts what it likes in its place. It
// returns a producer whose bound on a stranger's reservation is 3s
// (2 × (Retries+1) × AckTimeout), the bucket and the name.
func freedUniqueness(t testing.TB, ctx context.Context, e *env, period time.Duration) (*worker.Producer, jetstream.KeyValue, string) {
	t.Helper()
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n, AckTimeout: 250 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	kv, err := e.js.KeyValue(ctx, worker.UniqueBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.UniqueKey("nightly", period)); err != nil {
		t.Fatal(err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var name string
	for k := range keys.Keys() {
		name = k
	}
	if err := kv.Purge(ctx, name); err != nil {
		t.Fatal(err)
	}
	return p, kv, name
}

// statusProducer is a producer of e's jobs that also knows e's lease
// bucket, as Cancel, Status and Wait need.
func (e *env) statusProducer(t testing.TB) *worker.Producer {
	t.Helper()
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n, Bucket: e.bucket})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitCommitted waits until a commit of progress through seq, the last
// job, is recorded.
func (r *recorder) waitCommitted(t testing.TB, within time.Duration, seq uint64) {
	t.Helper()
	r.waitFor(t, within, "progress past every job", func() bool {
		return r.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventProgressCommitted && ev.Seq == seq
		}) > 0
	})
}

// startRecorded starts worker "w" on e with a handler that records each
// run and returns, and a recorder of its events.
func (e *env) startRecorded(t testing.TB) (*runLog, *recorder) {
	t.Helper()
	runs, rec := &runLog{}, newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error {
		runs.add(j)
		return nil
	}))
	cfg.Observer = rec
	start(t, cfg)
	return runs, rec
}
