package telemetry_test

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/telemetry"
)

func TestCarrierReadsAnyCase(t *testing.T) {
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	prop := propagation.TraceContext{}
	for _, name := range []string{"traceparent", "Traceparent", "TRACEPARENT"} {
		h := nats.Header{}
		h[name] = []string{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
		got := trace.SpanContextFromContext(prop.Extract(context.Background(), telemetry.HeaderCarrier(h)))
		if !got.Equal(sc) {
			t.Errorf("%s: extracted %v", name, got)
		}
		// The stock carrier misses the lowercase spelling nats.Header keeps.
		if name == "traceparent" {
			if stock := trace.SpanContextFromContext(prop.Extract(context.Background(), propagation.HeaderCarrier(h))); stock.IsValid() {
				t.Log("propagation.HeaderCarrier now reads lowercase names too")
			}
		}
	}
	h := nats.Header{"Traceparent": {"stale"}}
	prop.Inject(trace.ContextWithSpanContext(context.Background(), sc), telemetry.HeaderCarrier(h))
	if len(h) != 1 || h.Get("traceparent") == "" {
		t.Fatalf("inject left %v", h)
	}
}
