package telemetry

import (
	"context"
	"os"
	"os/exec"
	"testing"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// idleGlobalChild runs TestIdleGlobalChild in a process of its own: it
// installs a global provider, which no test of this process may see.
const idleGlobalChild = "LEASEHOLD_TEST_IDLE_GLOBAL"

func TestIdleGlobal(t *testing.T) {
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestIdleGlobalChild$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), idleGlobalChild+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("%s", out)
}

// TestIdleGlobalChild checks what a Telemetry built over the global
// provider before one is installed does, before and after it is.
func TestIdleGlobalChild(t *testing.T) {
	if os.Getenv(idleGlobalChild) == "" {
		t.Skip("run by TestIdleGlobal, in a process of its own")
	}
	tel := New(Config{})
	if _, ok := tel.Tracer.(*idleGlobal); !ok {
		t.Fatalf("the tracer over the global provider is a %T, want an *idleGlobal", tel.Tracer)
	}
	bg := context.Background()

	// No trace context: a span that records nothing, and names the
	// global provider; under it, the context is left as it is.
	ctx, span := tel.Tracer.Start(bg, "job")
	if span.IsRecording() || span.SpanContext().IsValid() {
		t.Fatalf("the span records (%v) or has a trace context (%v)", span.IsRecording(), span.SpanContext())
	}
	if trace.SpanFromContext(ctx) != span {
		t.Fatal("the context does not carry the span")
	}
	if span.TracerProvider() != otel.GetTracerProvider() {
		t.Fatalf("the span names %T, want the global provider", span.TracerProvider())
	}
	if child, _ := tel.Tracer.Start(ctx, "effect"); child != ctx {
		t.Fatal("a span under the idle span added to the context")
	}
	// One allocation at most, the context; none under the idle span.
	// The global tracer's span took two (starts that probe it aside).
	top := testing.AllocsPerRun(1000, func() { tel.Tracer.Start(bg, "job") })
	nested := testing.AllocsPerRun(1000, func() { tel.Tracer.Start(ctx, "effect") })
	if top > 1.1 || nested > 0.1 {
		t.Errorf("allocations a start: %.2f at the top, %.2f under the idle span; want 1 and 0", top, nested)
	}

	// A trace context is carried on, by the global tracer's span.
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled, Remote: true})
	_, traced := tel.Tracer.Start(trace.ContextWithRemoteSpanContext(bg, sc), "job")
	if traced.SpanContext().TraceID() != sc.TraceID() {
		t.Fatalf("under a remote parent, the span's trace context is %v, want the parent's", traced.SpanContext())
	}

	// Once a provider is installed, every span is its: the first start
	// after it records.
	rec := tracetest.NewSpanRecorder()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	_, s := tel.Tracer.Start(bg, "after")
	if !s.IsRecording() {
		t.Fatal("a span started after a provider was installed records nothing")
	}
	s.End()
	if ended := rec.Ended(); len(ended) != 1 || ended[0].Name() != "after" {
		t.Fatalf("the installed provider has %d spans, want the one named after", len(ended))
	}
}

// TestIdleGlobalProbes checks that a global tracer that records without a
// provider installed (as the eBPF auto-instrumentation makes it) is found
// within probeEvery starts, and has every span from then on. The global
// tracer stands in here as a real SDK tracer, which records.
func TestIdleGlobalProbes(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	sdk := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	tp := otel.GetTracerProvider()
	if !isGlobalDelegate(tp) {
		t.Skip("a provider is installed in this process")
	}
	g := &idleGlobal{tr: sdk.Tracer("probe"), tp: tp, span: &idleSpan{tp: tp}}
	bg := context.Background()
	for i := 1; i < probeEvery; i++ {
		if _, s := g.Start(bg, "idle"); s != g.span {
			t.Fatalf("start %d: a span of the global tracer before the probe", i)
		}
	}
	if _, s := g.Start(bg, "probe"); !s.IsRecording() {
		t.Fatal("the probe did not start a span of the global tracer")
	}
	for i := range 3 {
		if _, s := g.Start(bg, "after"); !s.IsRecording() {
			t.Fatalf("start %d after the probe recorded: the idle span again", i)
		}
	}
	if n := len(rec.Started()); n != 4 {
		t.Fatalf("the global tracer started %d spans, want 4", n)
	}
}
