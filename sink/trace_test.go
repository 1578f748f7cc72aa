package sink_test

import (
	"context"
	"errors"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// An Apply under a traced caller gets an apply span beneath the caller's;
// a refusal marks that span with the stale epoch's attributes and event,
// naming the holder the fence was advanced for; an untraced refusal still
// gets a span of its own, and an untraced write none. Every decision is
// counted by sink and outcome.
func TestApplySpansAndCounts(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	m := sink.NewMemory(sink.MemoryConfig{Logger: quiet(), Telemetry: telemetry.Config{TracerProvider: tp, MeterProvider: mp}})

	ctx, handler := tp.Tracer("test").Start(context.Background(), "process jobs")
	old := leasehold.Stamp{Scope: "orders", Acquisition: "a", Partition: 3, Epoch: 7, Key: "k1", Worker: "a"}
	if err := m.Apply(ctx, sink.Effect{Stamp: old, Subject: "s"}); err != nil {
		t.Fatal(err)
	}
	if err := m.Advance(context.Background(), leasehold.Lease{Scope: "orders", Partition: 3, Epoch: 9, Acquisition: "a9", Holder: "b"}); err != nil {
		t.Fatal(err)
	}
	old.Key = "k2"
	err := m.Apply(ctx, sink.Effect{Stamp: old, Subject: "s"})
	var se *leasehold.StaleEpochError
	if !errors.As(err, &se) || se.Holder != "b" {
		t.Fatalf("refusal %v, want a stale epoch naming holder b", err)
	}
	handler.End()
	old.Key = "k3"
	_ = m.Apply(context.Background(), sink.Effect{Stamp: old, Subject: "s"})                                                                      // untraced refusal
	_ = m.Apply(context.Background(), sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Acquisition: "a9", Partition: 3, Epoch: 9, Key: "k4"}}) // untraced write

	var applies []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "apply" {
			applies = append(applies, s)
		}
	}
	if len(applies) != 3 {
		t.Fatalf("%d apply spans, want 3 (two under the handler, one for the untraced refusal)", len(applies))
	}
	hid := handler.SpanContext().SpanID()
	if applies[0].Parent().SpanID() != hid || applies[0].Status().Code == codes.Error || get(applies[0], telemetry.AttrOutcome) != "accepted" {
		t.Errorf("accepted write: parent %v, status %v, outcome %v", applies[0].Parent().SpanID(), applies[0].Status(), get(applies[0], telemetry.AttrOutcome))
	}
	for i, s := range applies[1:] {
		if (i == 0) != (s.Parent().SpanID() == hid) {
			t.Errorf("refusal %d: parent %v", i, s.Parent().SpanID())
		}
		if s.Status().Code != codes.Error || get(s, "error.type") != "stale_epoch" || len(s.Events()) != 1 || s.Events()[0].Name != telemetry.EventFenceRejected {
			t.Errorf("refusal %d: status %v, error.type %v, events %v", i, s.Status(), get(s, "error.type"), s.Events())
		}
		for k, want := range map[attribute.Key]any{
			telemetry.AttrPartition: int64(3), telemetry.AttrEpoch: int64(7), telemetry.AttrMaxEpoch: int64(9),
			telemetry.AttrWorker: "a", telemetry.AttrHolder: "b", telemetry.AttrSink: "memory",
		} {
			if got := get(s, k); got != want {
				t.Errorf("refusal %d: %s = %v, want %v", i, k, got, want)
			}
		}
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name != "leasehold.sink.effects" {
				continue
			}
			for _, dp := range mt.Data.(metricdata.Sum[int64]).DataPoints {
				o, _ := dp.Attributes.Value(telemetry.AttrOutcome)
				s, _ := dp.Attributes.Value(telemetry.AttrSink)
				counts[s.AsString()+"/"+o.AsString()] = dp.Value
			}
		}
	}
	want := map[string]int64{"memory/accepted": 2, "memory/rejected_stale": 2, "memory/advanced": 1}
	for k, v := range want {
		if counts[k] != v {
			t.Errorf("leasehold.sink.effects %s = %d, want %d (all: %v)", k, counts[k], v, counts)
		}
	}
}

func get(s sdktrace.ReadOnlySpan, k attribute.Key) any {
	for _, a := range s.Attributes() {
		if a.Key == k {
			return a.Value.AsInterface()
		}
	}
	return nil
}

// A refusal under a trace that was sampled out still gets a span: the root
// of a trace of its own, linked to the writer's span.
func TestRefusalOutsideSampledTrace(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)) // parent-based, roots always sampled
	defer tp.Shutdown(context.Background())
	m := sink.NewMemory(sink.MemoryConfig{Logger: quiet(), Telemetry: telemetry.Config{TracerProvider: tp}})
	if err := m.Advance(context.Background(), leasehold.Lease{Scope: "orders", Partition: 1, Epoch: 5, Acquisition: "a5", Holder: "w"}); err != nil {
		t.Fatal(err)
	}
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, Remote: true})
	ctx, handler := tp.Tracer("test").Start(trace.ContextWithRemoteSpanContext(context.Background(), unsampled), "process jobs")
	if handler.IsRecording() {
		t.Fatal("the handler's span records under an unsampled parent")
	}
	_ = m.Apply(ctx, sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Acquisition: "a", Partition: 1, Epoch: 2, Key: "k", Worker: "a"}})
	handler.End()
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want the refusal's", len(spans))
	}
	s := spans[0]
	if s.Parent().IsValid() || s.SpanContext().TraceID() == tid || len(s.Links()) != 1 || s.Links()[0].SpanContext.SpanID() != handler.SpanContext().SpanID() {
		t.Fatalf("refusal span: parent %v, trace %v, links %v; want a root linked to the handler's span", s.Parent(), s.SpanContext().TraceID(), s.Links())
	}
	if get(s, "error.type") != "stale_epoch" || get(s, telemetry.AttrSink) != "memory" {
		t.Fatalf("refusal span attributes %v", s.Attributes())
	}
}

// BenchmarkStartProcess measures the process span a log-reading sink
// starts for each message, with no tracer provider set (the global
// tracer's), the message carrying its sender's trace context:
//
//	go test ./sink -run '^$' -bench StartProcess -benchmem
func BenchmarkStartProcess(b *testing.B) {
	r := sink.NewReporter(sink.ReporterConfig{Name: "orders-sink"})
	h := telemetry.HeaderCarrier{"Traceparent": []string{"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	st := leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 5, Acquisition: "a5", Key: "k"}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		_, span := r.StartProcess(ctx, h, "orders.out.3", st)
		span.End()
	}
}
