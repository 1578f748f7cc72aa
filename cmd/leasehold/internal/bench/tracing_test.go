package bench

import (
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// The receiver's span count walks the wire format: it must agree with a
// full decode, whatever else the export carries around the spans.
func TestCountSpans(t *testing.T) {
	t.Parallel()
	attr := []*commonpb.KeyValue{{Key: "k", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: "v"}}}}
	req := &coltracepb.ExportTraceServiceRequest{}
	want := 0
	for r := range 3 {
		rs := &tracepb.ResourceSpans{Resource: &resourcepb.Resource{Attributes: attr}, SchemaUrl: "https://example.com/schema"}
		for s := range r + 1 {
			ss := &tracepb.ScopeSpans{Scope: &commonpb.InstrumentationScope{Name: "scope"}}
			for i := range 2*s + 1 {
				ss.Spans = append(ss.Spans, &tracepb.Span{Name: "span", TraceId: make([]byte, 16), SpanId: make([]byte, 8), Attributes: attr, StartTimeUnixNano: uint64(i)})
				want++
			}
			rs.ScopeSpans = append(rs.ScopeSpans, ss)
		}
		req.ResourceSpans = append(req.ResourceSpans, rs)
	}
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if got := countSpans(b); got != want {
		t.Fatalf("countSpans = %d, want %d", got, want)
	}
	if got := countSpans(b[:len(b)-3]); got >= want {
		t.Fatalf("countSpans of a truncated export = %d, want fewer than %d", got, want)
	}
	if got := countSpans(nil); got != 0 {
		t.Fatalf("countSpans(nil) = %d", got)
	}
}
