package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// receiver is an OTLP/HTTP trace receiver: it decodes what exporters post
// to /v1/traces.
type receiver struct {
	srv *httptest.Server

	mu       sync.Mutex
	requests []*coltracepb.ExportTraceServiceRequest
	paths    []string
}

func newReceiver(t *testing.T) *receiver {
	t.Helper()
	r := &receiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		if err != nil || req.Header.Get("Content-Type") != "application/x-protobuf" {
			http.Error(w, "want an OTLP protobuf body", http.StatusBadRequest)
			return
		}
		var msg coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &msg); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		r.requests = append(r.requests, &msg)
		r.paths = append(r.paths, req.URL.Path)
		r.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

// otlpSpan is a received span with its resource's service name.
type otlpSpan struct {
	service string
	span    *tracepb.Span
}

// setupDefaultSampler runs Setup exporting to rcv with no sampler
// configured, in the environment either, and shuts it down when the test
// ends; shutdown flushes what it recorded before that.
func setupDefaultSampler(t *testing.T, rcv *receiver) (tel *telemetry.Telemetry, shutdown func(context.Context) error) {
	t.Helper()
	t.Setenv("OTEL_TRACES_SAMPLER", "")
	tel, _, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{OTLPEndpoint: rcv.srv.URL, NoGlobals: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { shutdown(context.Background()) })
	return tel, shutdown
}

func (r *receiver) spans() []otlpSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []otlpSpan
	for _, req := range r.requests {
		for _, rs := range req.ResourceSpans {
			service := ""
			if v, ok := kv(rs.GetResource().GetAttributes(), "service.name"); ok {
				service = v.GetStringValue()
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					out = append(out, otlpSpan{service, s})
				}
			}
		}
	}
	return out
}

func kv(attrs []*commonpb.KeyValue, key string) (*commonpb.AnyValue, bool) {
	for _, a := range attrs {
		if a.Key == key {
			return a.Value, true
		}
	}
	return nil, false
}

// Setup exports spans over OTLP/HTTP: the zombie's refused writes reach a
// receiver, with their attributes, event and status, under the service
// name asked for.
func TestSetupExportsRejectedWrites(t *testing.T) {
	rcv := newReceiver(t)
	tel, metrics, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{
		ServiceName: "zombie-otlp", OTLPEndpoint: rcv.srv.URL, NoGlobals: true,
		// The zombie's whole trace, not the refusals alone.
		Sampler: sdktrace.AlwaysSample(),
	})
	if err != nil {
		t.Fatal(err)
	}
	run := runZombie(t, tel.Config())
	body := scrape(t, serve(t, metrics)+"/metrics")
	if !strings.Contains(body, `service_name="zombie-otlp"`) {
		t.Errorf("/metrics has no target_info for the service:\n%s", grep(body, "target_info"))
	}
	if err := shutdown(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}

	var refused []otlpSpan
	for _, s := range rcv.spans() {
		if v, ok := kv(s.span.Attributes, "error.type"); ok && v.GetStringValue() == telemetry.ErrorTypeStaleEpoch {
			refused = append(refused, s)
		}
	}
	sinks := map[string]bool{}
	for _, s := range refused {
		if s.service != "zombie-otlp" {
			t.Errorf("span %q from service %q", s.span.Name, s.service)
		}
		if got := [16]byte(s.span.TraceId); got != run.traceID {
			t.Errorf("span %q in trace %x, want %v", s.span.Name, got, run.traceID)
		}
		if s.span.Status.GetCode() != tracepb.Status_STATUS_CODE_ERROR {
			t.Errorf("span %q: status %v", s.span.Name, s.span.Status)
		}
		sinkName, _ := kv(s.span.Attributes, "leasehold.sink")
		if sinkName == nil {
			continue // A's process span, which returned the refusal
		}
		sinks[sinkName.GetStringValue()] = true
		for key, want := range map[string]int64{"leasehold.epoch": int64(run.epochA), "leasehold.max_epoch": int64(run.epochB), "leasehold.partition": 0} {
			if v, ok := kv(s.span.Attributes, key); !ok || v.GetIntValue() != want {
				t.Errorf("%s refusal: %s = %v, want %d", sinkName.GetStringValue(), key, v, want)
			}
		}
		for key, want := range map[string]string{"leasehold.worker": zombieA, "leasehold.holder": zombieB} {
			if v, ok := kv(s.span.Attributes, key); !ok || v.GetStringValue() != want {
				t.Errorf("%s refusal: %s = %v, want %s", sinkName.GetStringValue(), key, v, want)
			}
		}
		if len(s.span.Events) == 0 || s.span.Events[0].Name != telemetry.EventFenceRejected {
			t.Errorf("%s refusal: events %v", sinkName.GetStringValue(), s.span.Events)
		}
	}
	if !sinks["memory"] || !sinks["kv"] || !sinks["stream"] {
		t.Fatalf("refusals arrived from %v, want memory, kv and stream", sinks)
	}
	rcv.mu.Lock()
	for _, p := range rcv.paths {
		if p != "/v1/traces" {
			t.Errorf("exporter posted to %s", p)
		}
	}
	rcv.mu.Unlock()

}

// Without an endpoint in the configuration, Setup follows the standard
// environment variables.
func TestSetupReadsEnvironment(t *testing.T) {
	rcv := newReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rcv.srv.URL)
	t.Setenv("OTEL_SERVICE_NAME", "from-env")
	t.Setenv("OTEL_TRACES_SAMPLER", "always_on")
	tel, _, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{NoGlobals: true})
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.Tracer.Start(context.Background(), "probe")
	span.End()
	if err := shutdown(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	got := rcv.spans()
	if len(got) != 1 || got[0].span.Name != "probe" || got[0].service != "from-env" {
		t.Fatalf("received %+v, want the probe span from service from-env", got)
	}

	// With neither, nothing is recorded, and trace context still flows.
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	tel, _, shutdown, err = telemetry.Setup(context.Background(), telemetry.SetupConfig{NoGlobals: true})
	if err != nil {
		t.Fatal(err)
	}
	defer shutdown(context.Background())
	if _, span := tel.Tracer.Start(context.Background(), "nowhere"); span.IsRecording() {
		t.Fatal("a span records with no endpoint configured")
	}
}

func TestSetupRefusesBadEndpoint(t *testing.T) {
	for _, bad := range []string{"127.0.0.1:4318", "ftp://host:4318", "http://"} {
		_, _, _, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{OTLPEndpoint: bad, NoGlobals: true})
		if err == nil || !strings.Contains(err.Error(), "http://127.0.0.1:4318") {
			t.Errorf("endpoint %q: %v, want an error that shows a usable URL", bad, err)
		}
	}
}

// A sampler that keeps nothing still keeps refused writes: Setup wraps it
// with KeepRefusals, and a refusal whose trace was not sampled starts one
// of its own.
func TestSetupKeepsRefusals(t *testing.T) {
	rcv := newReceiver(t)
	t.Setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
	t.Setenv("OTEL_TRACES_SAMPLER_ARG", "0")
	tel, _, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{OTLPEndpoint: rcv.srv.URL, NoGlobals: true})
	if err != nil {
		t.Fatal(err)
	}
	mem := sink.NewMemory(sink.MemoryConfig{Logger: quiet(), Telemetry: tel.Config()})
	if err := mem.Advance(context.Background(), leasehold.Lease{Scope: "orders", Partition: 0, Epoch: 9, Acquisition: "a9", Holder: "b"}); err != nil {
		t.Fatal(err)
	}
	ctx, handler := tel.Tracer.Start(context.Background(), "process jobs")
	if handler.IsRecording() {
		t.Fatal("a ratio of 0 sampled the handler's span")
	}
	_ = mem.Apply(ctx, sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 0, Epoch: 8, Acquisition: "a8", Key: "k", Worker: "a"}})
	_ = mem.Apply(ctx, sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 0, Epoch: 9, Acquisition: "a9", Key: "k2", Worker: "b"}})
	handler.End()
	if err := shutdown(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	got := rcv.spans()
	if len(got) != 1 {
		t.Fatalf("%d spans exported, want the refusal alone", len(got))
	}
	s := got[0].span
	if v, _ := kv(s.Attributes, "error.type"); v.GetStringValue() != telemetry.ErrorTypeStaleEpoch || len(s.Links) != 1 || len(s.ParentSpanId) != 0 {
		t.Fatalf("exported %q: attributes %v, links %v, parent %x", s.Name, s.Attributes, s.Links, s.ParentSpanId)
	}

	t.Setenv("OTEL_TRACES_SAMPLER", "sometimes")
	if _, _, _, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{OTLPEndpoint: rcv.srv.URL, NoGlobals: true}); err == nil || !strings.Contains(err.Error(), "OTEL_TRACES_SAMPLER") {
		t.Fatalf("an unknown sampler: %v", err)
	}
}

// With no sampler configured, Setup records one in ten new traces, every
// trace whose parent was sampled, and every refused write, whether or not
// its trace was sampled.
func TestSetupDefaultSampler(t *testing.T) {
	rcv := newReceiver(t)
	tel, shutdown := setupDefaultSampler(t, rcv)

	// 2000 new traces at 1 in 10: 200 expected, standard deviation 13.4;
	// 120 and 280 are six deviations away.
	const n = 2000
	sampled := 0
	var unsampled []context.Context
	for range n {
		ctx, span := tel.Tracer.Start(context.Background(), "process orders.jobs.{partition}")
		if span.SpanContext().IsSampled() {
			sampled++
			_, child := tel.Tracer.Start(ctx, "send orders.out.{partition}")
			if !child.SpanContext().IsSampled() {
				t.Fatal("the child of a sampled span was not sampled")
			}
			child.End()
		} else {
			unsampled = append(unsampled, ctx)
		}
		span.End()
	}
	if sampled < 120 || sampled > 280 {
		t.Errorf("%d of %d new traces sampled, want about %v", sampled, n, telemetry.DefaultSampleRatio*n)
	}
	// A remote parent that was sampled is followed, one that was not too.
	for _, flags := range []trace.TraceFlags{trace.FlagsSampled, 0} {
		parent := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: flags, Remote: true})
		_, span := tel.Tracer.Start(trace.ContextWithRemoteSpanContext(context.Background(), parent), "process")
		if span.SpanContext().IsSampled() != parent.IsSampled() {
			t.Errorf("parent sampled %v, child sampled %v", parent.IsSampled(), span.SpanContext().IsSampled())
		}
		span.End()
	}

	// Ten refused writes, each in a trace that was not sampled: all ten
	// are recorded.
	mem := sink.NewMemory(sink.MemoryConfig{Logger: quiet(), Telemetry: tel.Config()})
	if err := mem.Advance(context.Background(), leasehold.Lease{Scope: "orders", Partition: 0, Epoch: 9, Acquisition: "a9", Holder: "b"}); err != nil {
		t.Fatal(err)
	}
	const refusals = 10
	if len(unsampled) < refusals {
		t.Fatalf("only %d unsampled traces", len(unsampled))
	}
	for i := range refusals {
		err := mem.Apply(unsampled[i], sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 0, Epoch: 8, Acquisition: "a8", Key: "k" + string(rune('a'+i)), Worker: "a"}})
		if err == nil {
			t.Fatal("a stale write was applied")
		}
	}
	if err := shutdown(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	got := 0
	for _, s := range rcv.spans() {
		if v, ok := kv(s.span.Attributes, "error.type"); ok && v.GetStringValue() == telemetry.ErrorTypeStaleEpoch {
			got++
		}
	}
	if got != refusals {
		t.Fatalf("%d refused writes recorded, want %d", got, refusals)
	}
}

// DefaultSampler is what Setup uses, and what the description says.
func TestDefaultSamplerDescription(t *testing.T) {
	var _ sdktrace.Sampler = telemetry.DefaultSampler()
	if d := telemetry.DefaultSampler().Description(); !strings.Contains(d, "TraceIDRatioBased{0.1}") {
		t.Fatalf("DefaultSampler = %s", d)
	}
}

// Under a parent that was not sampled, Setup's tracer (with the default
// sampler) hands back a span that records nothing, carries the parent's
// context and names Setup's provider; with attributes at the start, the
// sampler decides, and a refusal is recorded.
func TestSetupStartsNoSpanUnderUnsampledParent(t *testing.T) {
	rcv := newReceiver(t)
	tel, _ := setupDefaultSampler(t, rcv)
	parent := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{7}, SpanID: trace.SpanID{7}, Remote: true})
	ctx, span := tel.Tracer.Start(trace.ContextWithRemoteSpanContext(context.Background(), parent), "process orders.jobs.{partition}",
		trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() || !span.SpanContext().Equal(parent) || !trace.SpanContextFromContext(ctx).Equal(parent) {
		t.Fatalf("child of an unsampled parent: recording %v, context %v; want the parent's %v", span.IsRecording(), span.SpanContext(), parent)
	}
	if span.TracerProvider() != tel.Config().TracerProvider {
		t.Errorf("the child's provider is %T, not Setup's", span.TracerProvider())
	}
	span.SetAttributes(telemetry.AttrEpoch.Int64(1))
	span.End()
	_, refusal := tel.Tracer.Start(ctx, "apply", trace.WithAttributes(semconv.ErrorTypeKey.String(telemetry.ErrorTypeStaleEpoch)))
	if !refusal.IsRecording() || refusal.SpanContext().TraceID() != parent.TraceID() {
		t.Errorf("a refusal under an unsampled parent: recording %v, trace %v", refusal.IsRecording(), refusal.SpanContext().TraceID())
	}
	refusal.End()

	for _, c := range []struct {
		s    sdktrace.Sampler
		want bool
	}{
		{telemetry.DefaultSampler(), true},
		{sdktrace.ParentBased(sdktrace.AlwaysSample()), true},
		{telemetry.KeepRefusals(telemetry.DefaultSampler()), true},
		{sdktrace.AlwaysSample(), false},
		{sdktrace.TraceIDRatioBased(0.1), false},
		{sdktrace.ParentBased(sdktrace.NeverSample(), sdktrace.WithRemoteParentNotSampled(sdktrace.AlwaysSample())), false},
		{sdktrace.ParentBased(sdktrace.NeverSample(), sdktrace.WithLocalParentNotSampled(sdktrace.AlwaysSample())), false},
	} {
		if got := telemetry.FollowsParent(c.s); got != c.want {
			t.Errorf("FollowsParent(%s) = %v, want %v", c.s.Description(), got, c.want)
		}
	}
}

// Setup's provider, wrapped or not, still flushes on demand.
func TestSetupProviderForceFlush(t *testing.T) {
	rcv := newReceiver(t)
	t.Setenv("OTEL_TRACES_SAMPLER", "")
	tel, _, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{OTLPEndpoint: rcv.srv.URL, NoGlobals: true, Sampler: sdktrace.ParentBased(sdktrace.AlwaysSample())})
	if err != nil {
		t.Fatal(err)
	}
	defer shutdown(context.Background())
	f, ok := tel.Config().TracerProvider.(interface{ ForceFlush(context.Context) error })
	if !ok {
		t.Fatalf("Setup's provider %T has no ForceFlush", tel.Config().TracerProvider)
	}
	_, span := tel.Tracer.Start(context.Background(), "flushed")
	span.End()
	if err := f.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := rcv.spans(); len(got) != 1 || got[0].span.GetName() != "flushed" {
		t.Fatalf("after ForceFlush the receiver has %d spans, want the one ended", len(got))
	}
}
