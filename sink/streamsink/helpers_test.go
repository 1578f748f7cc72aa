package streamsink_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// Set-up shared by the tests that run a worker beside the runner: a job
// stream of one partition, its lease bucket, the worker, and waits on
// what they write.

// startTopo starts a single server, or a three-node cluster when topo is
// "cluster", and returns its JetStream and the replicas to ask for.
func startTopo(t testing.TB, topo string) (jetstream.JetStream, int) {
	t.Helper()
	if topo == "cluster" {
		return natstest.StartCluster(t).JetStream(t), 3
	}
	return natstest.Start(t).JetStream(t), 1
}

// provisionJobs provisions a job stream of one partition under prefix and
// its lease bucket (<prefix>-leases, markers kept a second), each with
// replicas.
func provisionJobs(t testing.TB, js jetstream.JetStream, prefix string, replicas int) *coordinator.Bucket {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: 1, Replicas: replicas}); err != nil {
		t.Fatal(err)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: prefix + "-leases", Replicas: replicas, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return bucket
}

// workerConfig is a worker, id, of the one partition under prefix,
// handling with h, with the tests' timings: a lease of two seconds,
// retries after 10ms, nothing logged.
func workerConfig(js jetstream.JetStream, prefix string, bucket *coordinator.Bucket, id string, h worker.Handler) worker.Config {
	return worker.Config{
		JetStream: js, Prefix: prefix, Partitions: 1, Bucket: bucket, Handler: h,
		Coordinator: coordinator.Config{Worker: id, TTL: 2 * time.Second, RebalanceDelay: 100 * time.Millisecond, Logger: quiet()},
		Backoff:     func(int) time.Duration { return 10 * time.Millisecond },
		Logger:      quiet(),
	}
}

// runWorker runs a worker with cfg until stop is called or the test
// ends. stop cancels Run and waits for it: the worker drains and releases
// its partition. A Run that fails fails the test.
func runWorker(t testing.TB, cfg worker.Config) (stop func()) {
	t.Helper()
	w, err := worker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("worker %s Run: %v", cfg.Coordinator.Worker, err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// tailLog returns the effect log under prefix as it is written, read by
// an ordered consumer from its start, as a forger with a worker's
// credentials reads it.
func tailLog(t testing.TB, js jetstream.JetStream, prefix string) <-chan jetstream.Msg {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	es, err := js.Stream(ctx, worker.EffectsStream(prefix))
	if err != nil {
		t.Fatal(err)
	}
	oc, err := es.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	log := make(chan jetstream.Msg, 4096)
	cc, err := oc.Consume(func(m jetstream.Msg) { log <- m })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
	return log
}

// settleLog waits until r has decided the whole effect log under prefix,
// as it stands now.
func settleLog(t testing.TB, js jetstream.JetStream, prefix string, r *running) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	s, err := js.Stream(ctx, worker.EffectsStream(prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.WaitPosition(ctx, info.State.LastSeq); err != nil {
		t.Fatal(err)
	}
}

// enqueueJobs enqueues n jobs under prefix, job i under key i with payload
// "job-i", and returns their sequences.
func enqueueJobs(t testing.TB, ctx context.Context, js jetstream.JetStream, prefix string, n int) []uint64 {
	t.Helper()
	p := producerOf(t, js, prefix)
	var seqs []uint64
	for i := range n {
		e, err := p.Enqueue(ctx, []byte(fmt.Sprint(i)), []byte(fmt.Sprintf("job-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, e.Seq)
	}
	return seqs
}

// awaitCommitted reads worker events until progress through seq is
// committed.
func awaitCommitted(t testing.TB, ctx context.Context, events <-chan worker.Event, seq uint64) {
	t.Helper()
	committed := uint64(0)
	for committed < seq {
		select {
		case e := <-events:
			if e.Kind == worker.EventProgressCommitted && e.Seq > committed {
				committed = e.Seq
			}
		case <-ctx.Done():
			t.Fatalf("the worker committed up to %d, want %d", committed, seq)
		}
	}
}

// emitEffectOf emits one effect, "effect of <payload>".
var emitEffectOf = worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
	return j.Emit(ctx, []byte(fmt.Sprintf("effect of %s", j.Data)))
})

// forwardEvents is an observer that passes worker events to events,
// dropping what does not fit.
func forwardEvents(events chan<- worker.Event) worker.Observer {
	return worker.ObserverFunc(func(_ context.Context, e worker.Event) {
		select {
		case events <- e:
		default:
		}
	})
}

// sinkMetric reads the int64 gauge or counter metric of sink name, as
// reader collects it: -1 when it has no data point for the sink.
func sinkMetric(t testing.TB, reader *sdkmetric.ManualReader, name, metric string) int64 {
	t.Helper()
	v := int64(-1)
	eachPoint(t, reader, metric, func(p metricdata.DataPoint[int64]) {
		if s, _ := p.Attributes.Value(telemetry.AttrSink); s.AsString() == name && v == -1 {
			v = p.Value
		}
	})
	return v
}

// eachPoint calls f with each data point of the int64 gauge or counter
// metric that reader collects.
func eachPoint(t testing.TB, reader *sdkmetric.ManualReader, metric string, f func(metricdata.DataPoint[int64])) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != metric {
				continue
			}
			switch d := m.Data.(type) {
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					f(p)
				}
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					f(p)
				}
			}
		}
	}
}

// logMsg is a message of the effect log as a forger read it.
type logMsg struct {
	seq     uint64
	subject string
	header  nats.Header
}

// awaitPause waits until the handler of job seq says on paused that it
// has paused.
func awaitPause(t testing.TB, paused <-chan uint64, seq uint64) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	select {
	case got := <-paused:
		if got != seq {
			t.Fatalf("job %d paused, want %d", got, seq)
		}
	case <-ctx.Done():
		t.Fatalf("job %d did not reach its pause", seq)
	}
}

// effectInLog reads log until an effect of job seq comes, its final when
// final, not an abort marker, and returns it.
func effectInLog(t testing.TB, log <-chan jetstream.Msg, seq uint64, final bool) logMsg {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	for {
		select {
		case m := <-log:
			mark, err := leasehold.JobMarkFromHeader(m.Headers())
			if err != nil || mark.Job != seq || mark.Final() != final || mark.Abort {
				continue
			}
			md, err := m.Metadata()
			if err != nil {
				t.Fatal(err)
			}
			return logMsg{seq: md.Sequence.Stream, subject: m.Subject(), header: m.Headers()}
		case <-ctx.Done():
			t.Fatalf("no effect of job %d (final %v) reached the log", seq, final)
		}
	}
}

// restamp returns headers that carry m's stamp, in the legacy form, with
// its key replaced by key when key is set: a forger's copy.
func restamp(t testing.TB, m logMsg, key string) nats.Header {
	t.Helper()
	st, err := leasehold.StampFromHeader(m.header)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		st.Key = key
	}
	h := nats.Header{}
	st.SetHeader(h)
	return h
}

// eachAndBatch runs f as the subtest "each", for a runner given a
// Handler, and as "batch", for one given a BatchHandler.
func eachAndBatch(t *testing.T, f func(t *testing.T, batch bool, name string)) {
	for _, batch := range []bool{false, true} {
		name := "each"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) { f(t, batch, name) })
	}
}

// producerOf is a producer of the one partition under prefix.
func producerOf(t testing.TB, js jetstream.JetStream, prefix string) *worker.Producer {
	t.Helper()
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// savedState is the state the runner under prefix saved for a restart,
// as stored.
func savedState(t testing.TB, js jetstream.JetStream, prefix string) []byte {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	kv, err := js.KeyValue(ctx, prefix+"-sink-state")
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, prefix+"-sink")
	if err != nil {
		t.Fatal(err)
	}
	return e.Value()
}
