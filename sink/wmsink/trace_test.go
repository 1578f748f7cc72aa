package wmsink_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/telemetry"
)

// Each message is a process span under the span that sent it (from the
// trace context in its metadata); the handler runs under it; a stale
// message's span is the refusal.
func TestMiddlewareSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	prop := propagation.TraceContext{}
	f, err := wmsink.New(wmsink.Config{UnsafeArrivalOrder: true, Logger: quiet(),
		Telemetry: telemetry.Config{TracerProvider: tp, Propagator: prop}})
	if err != nil {
		t.Fatal(err)
	}
	var handled []trace.SpanContext
	h := f.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		handled = append(handled, trace.SpanContextFromContext(msg.Context()))
		return nil, nil
	})
	send := func(s leasehold.Stamp) trace.Span {
		ctx, span := tp.Tracer("test").Start(context.Background(), "send effects")
		msg := message.NewMessage(s.Key, nil)
		s.SetMetadata(msg.Metadata)
		prop.Inject(ctx, telemetry.MetadataCarrier(msg.Metadata))
		span.End()
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
		return span
	}
	fresh := send(leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 9, Acquisition: "a9", Key: "new", Worker: "b"})
	stale := send(leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 7, Acquisition: "a7", Key: "old", Worker: "a"})

	byParent := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.SpanKind() == trace.SpanKindConsumer {
			byParent[s.Parent().SpanID()] = s
		}
	}
	ok := byParent[fresh.SpanContext().SpanID()]
	if ok == nil || ok.Status().Code == codes.Error || len(handled) != 1 || handled[0].SpanID() != ok.SpanContext().SpanID() {
		t.Fatalf("the admitted message's span %v; the handler ran under %v", ok, handled)
	}
	refused := byParent[stale.SpanContext().SpanID()]
	if refused == nil || refused.Status().Code != codes.Error || len(refused.Events()) == 0 || refused.Events()[0].Name != telemetry.EventFenceRejected {
		t.Fatalf("the stale message's span: %v", refused)
	}
	attrs := map[string]any{}
	for _, a := range refused.Attributes() {
		attrs[string(a.Key)] = a.Value.AsInterface()
	}
	if attrs["error.type"] != "stale_epoch" || attrs["leasehold.worker"] != "a" || attrs["leasehold.max_epoch"] != int64(9) {
		t.Fatalf("the stale message's span attributes: %v", attrs)
	}
}

// A stale message whose trace was sampled out is still traced: a consumer
// span of a trace of its own, linked to the span that sent it.
func TestStaleMessageOutsideSampledTrace(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	prop := propagation.TraceContext{}
	f, err := wmsink.New(wmsink.Config{UnsafeArrivalOrder: true, Logger: quiet(), Telemetry: telemetry.Config{TracerProvider: tp, Propagator: prop}})
	if err != nil {
		t.Fatal(err)
	}
	barrier := map[string]string{leasehold.HeaderBarrier: "1"}
	leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 9, Acquisition: "a9", Key: "barrier", Worker: "b"}.SetMetadata(barrier)
	if err := f.Fence(context.Background(), barrier, nil); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("old", nil)
	leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 7, Acquisition: "a7", Key: "old", Worker: "a"}.SetMetadata(msg.Metadata)
	msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00") // not sampled
	if _, err := f.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg); err != nil {
		t.Fatal(err)
	}
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want the barrier's and the refusal's", len(spans))
	}
	s := spans[1]
	if s.SpanKind() != trace.SpanKindConsumer || s.Parent().IsValid() || len(s.Links()) != 1 || s.Links()[0].SpanContext.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("refusal span %q: kind %v, parent %v, links %v; want a consumer root linked to the sender", s.Name(), s.SpanKind(), s.Parent(), s.Links())
	}
	if s.Status().Code != codes.Error || len(s.Events()) != 1 || s.Events()[0].Name != telemetry.EventFenceRejected {
		t.Fatalf("refusal span: status %v, events %v", s.Status(), s.Events())
	}
}
