package wmstamp_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/wmstamp"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// runJobs runs a worker with handler h over count jobs on one partition
// and waits until each has been handled once.
func runJobs(t *testing.T, count int, prop propagation.TextMapPropagator, h worker.HandlerFunc) {
	t.Helper()
	var wg sync.WaitGroup
	wg.Add(count)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	runWorker(t, count, prop, func(ctx context.Context, j *worker.Job) error {
		defer wg.Done()
		return h(ctx, j)
	}, done)
}

// runWorker runs a worker with handler h over count jobs on one partition
// until done is closed.
func runWorker(t *testing.T, count int, prop propagation.TextMapPropagator, h worker.HandlerFunc, done <-chan struct{}, tweak ...func(*worker.Config)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js := natstest.Start(t).JetStream(t)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "wm-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "wm", Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "wm", Partitions: 1, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	for range count {
		if _, err := p.EnqueueTo(ctx, 0, []byte("job")); err != nil {
			t.Fatal(err)
		}
	}
	wc := worker.Config{
		JetStream:   js,
		Prefix:      "wm",
		Partitions:  1,
		Bucket:      b,
		Coordinator: coordinator.Config{Worker: "w"},
		Propagator:  prop,
		Backoff:     func(int) time.Duration { return 10 * time.Millisecond },
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler:     h,
	}
	for _, f := range tweak {
		f(&wc)
	}
	w, err := worker.New(wc)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	rctx, stop := context.WithCancel(context.Background())
	go func() { errc <- w.Run(rctx) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Error("the jobs were not handled in time")
	}
	stop()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// Messages published from a handler through a stamping publisher carry
// the job's stamp and trace context in their metadata; the keys continue
// the job's effect numbering.
func TestPublisherStampsMessages(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer pubsub.Close()
	prop := propagation.TraceContext{}
	pub, err := wmstamp.Decorator(wmstamp.Config{Propagator: prop})(pubsub)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var want []leasehold.Stamp
	var traceIDs []trace.TraceID
	runJobs(t, 2, prop, func(ctx context.Context, j *worker.Job) error {
		tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
		sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
		ctx = trace.ContextWithSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
		if err := pub.Publish("out",
			message.NewMessageWithContext(ctx, "a", []byte("1")),
			message.NewMessageWithContext(ctx, "b", []byte("2"))); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		for i := range 2 {
			want = append(want, j.Lease.Stamp(leasehold.EffectKey("wm", j.Partition, j.Seq, i)))
		}
		traceIDs = append(traceIDs, tid, tid)
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	msgs, err := pubsub.Subscribe(ctx, "out")
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string]leasehold.Stamp{}
	for _, s := range want {
		byKey[s.Key] = s
	}
	for i := range want {
		var m *message.Message
		select {
		case m = <-msgs:
		case <-ctx.Done():
			t.Fatalf("message %d never arrived", i)
		}
		m.Ack()
		got, err := leasehold.StampFromMetadata(m.Metadata)
		if err != nil || got != byKey[got.Key] {
			t.Fatalf("message %s: stamp %+v (%v), want one of %v", m.UUID, got, err, want)
		}
		delete(byKey, got.Key)
		if idx := map[string]string{"a": ".0", "b": ".1"}[m.UUID]; !strings.HasSuffix(got.Key, idx) {
			t.Fatalf("message %s got key %s: stamps are numbered in publishing order", m.UUID, got.Key)
		}
		if tp := m.Metadata.Get("traceparent"); !strings.Contains(tp, traceIDs[i].String()) {
			t.Fatalf("message %s: traceparent %q", m.UUID, tp)
		}
	}
}

// A message without a job in its context, or published after its handler
// returned, is refused and nothing of the call is published.
func TestPublisherRefusesUnstampableMessages(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer pubsub.Close()
	pub := wmstamp.NewPublisher(pubsub, wmstamp.Config{})
	var late context.Context
	var noJob error
	runJobs(t, 1, nil, func(ctx context.Context, j *worker.Job) error {
		late = ctx
		noJob = pub.Publish("out",
			message.NewMessageWithContext(ctx, "ok", nil),
			message.NewMessage("bare", nil))
		return nil
	})
	if !errors.Is(noJob, wmstamp.ErrNoJob) || !strings.Contains(noJob.Error(), "NewMessageWithContext") {
		t.Fatalf("publishing a message without a job: %v", noJob)
	}
	err := pub.Publish("out", message.NewMessageWithContext(late, "late", nil))
	if !errors.Is(err, worker.ErrJobDone) {
		t.Fatalf("publishing after the handler returned: %v", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	msgs, err := pubsub.Subscribe(sctx, "out")
	if err != nil {
		t.Fatal(err)
	}
	for m := range msgs {
		t.Fatalf("message %s was published", m.UUID)
	}
}

// Each message gets a send span under the handler's span, and carries the
// send span's context, so that a consumer's span hangs under it.
func TestPublisherSendSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	prop := propagation.TraceContext{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer pubsub.Close()
	pub := wmstamp.NewPublisher(pubsub, wmstamp.Config{Telemetry: telemetry.Config{TracerProvider: tp, Propagator: prop}})
	var parent trace.SpanContext
	runJobs(t, 1, prop, func(ctx context.Context, j *worker.Job) error {
		ctx, span := tp.Tracer("test").Start(ctx, "handler")
		defer span.End()
		parent = span.SpanContext()
		return pub.Publish("orders.0", message.NewMessageWithContext(ctx, "a", []byte("1")))
	})
	var send sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "send orders.{partition}" {
			send = s
		}
	}
	if send == nil || send.SpanKind() != trace.SpanKindProducer || send.Parent().SpanID() != parent.SpanID() {
		t.Fatalf("send span %v, want a producer span under the handler's %v", send, parent.SpanID())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	msgs, err := pubsub.Subscribe(ctx, "orders.0")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		got := trace.SpanContextFromContext(prop.Extract(context.Background(), telemetry.MetadataCarrier(m.Metadata)))
		if got.SpanID() != send.SpanContext().SpanID() {
			t.Fatalf("the message carries span %v, want the send span %v", got.SpanID(), send.SpanContext().SpanID())
		}
	case <-ctx.Done():
		t.Fatal("the message never arrived")
	}
}
