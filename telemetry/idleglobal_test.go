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
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"
)

// idleGlobalChild runs TestIdleGlobalChild in a process of its own, with
// the scenario it names: each installs a global provider, which no other
// test may see.
const idleGlobalChild = "LEASEHOLD_TEST_IDLE_GLOBAL"

func TestIdleGlobal(t *testing.T) {
	t.Parallel()
	for _, scenario := range []string{"installed", "restored", "uncomparable"} {
		t.Run(scenario, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^TestIdleGlobalChild$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), idleGlobalChild+"="+scenario)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			t.Logf("%s", out)
		})
	}
}

func TestIdleGlobalChild(t *testing.T) {
	switch os.Getenv(idleGlobalChild) {
	case "":
		t.Skip("run by TestIdleGlobal, in a process of its own")
	case "installed":
		idleThenInstalled(t)
	case "restored":
		installedAndRestored(t)
	case "uncomparable":
		uncomparableInstalled(t)
	default:
		t.Fatalf("no scenario %q", os.Getenv(idleGlobalChild))
	}
}

// idleThenInstalled checks what a Telemetry built over the global provider
// before one is installed does, before and after it is.
func idleThenInstalled(t *testing.T) {
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

	// A trace context is carried on, sampled or not, by the global
	// tracer's span.
	for _, flags := range []trace.TraceFlags{trace.FlagsSampled, 0} {
		sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: flags, Remote: true})
		_, traced := tel.Tracer.Start(trace.ContextWithRemoteSpanContext(bg, sc), "job")
		if got := traced.SpanContext(); got.TraceID() != sc.TraceID() || got.TraceFlags() != flags {
			t.Fatalf("under a remote parent with flags %v, the span's trace context is %v, want the parent's", flags, got)
		}
	}

	// Once a provider is installed, every span is its: the first start
	// after it records.
	rec := tracetest.NewSpanRecorder()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	for i := range 3 {
		_, s := tel.Tracer.Start(bg, "after")
		if !s.IsRecording() {
			t.Fatalf("start %d after a provider was installed records nothing", i)
		}
		s.End()
	}
	if ended := rec.Ended(); len(ended) != 3 || ended[0].Name() != "after" {
		t.Fatalf("the installed provider has %d spans, want the three named after", len(ended))
	}
}

// installedAndRestored installs a provider and puts the global one back,
// with no span started between: the global provider is the current one
// again, but forwards to the installed one for good. The probe finds it;
// a Telemetry built after it is not wrapped at all.
func installedAndRestored(t *testing.T) {
	tel := New(Config{})
	if _, ok := tel.Tracer.(*idleGlobal); !ok {
		t.Fatalf("the tracer over the global provider is a %T, want an *idleGlobal", tel.Tracer)
	}
	prev := otel.GetTracerProvider()
	rec := tracetest.NewSpanRecorder()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	otel.SetTracerProvider(prev)
	if otel.GetTracerProvider() != prev {
		t.Fatal("the global provider was not put back")
	}
	if later := New(Config{}); later.Tracer == nil || isIdle(later.Tracer) {
		t.Fatalf("a Telemetry built after a provider was installed has a %T, want the installed provider's tracer", later.Tracer)
	}
	bg := context.Background()
	found := -1
	for i := range probeEvery {
		if _, s := tel.Tracer.Start(bg, "job"); s.IsRecording() {
			found = i
			break
		}
	}
	if found < 0 {
		t.Fatalf("no span of %d recorded after the provider was installed", probeEvery)
	}
	for i := range 3 {
		if _, s := tel.Tracer.Start(bg, "job"); !s.IsRecording() {
			t.Fatalf("start %d after the probe found the provider records nothing", i)
		}
	}
	t.Logf("the probe found the installed provider at start %d", found+1)
}

func isIdle(tr trace.Tracer) bool { _, ok := tr.(*idleGlobal); return ok }

// uncomparableProvider is a provider of a type that is not comparable: two
// interfaces holding it cannot be compared.
type uncomparableProvider struct {
	embedded.TracerProvider
	attrs []string
}

func (uncomparableProvider) Tracer(string, ...trace.TracerOption) trace.Tracer {
	return noop.NewTracerProvider().Tracer("")
}

// uncomparableInstalled installs such a provider globally: New must not
// compare it with itself.
func uncomparableInstalled(t *testing.T) {
	otel.SetTracerProvider(uncomparableProvider{attrs: []string{"a"}})
	tel := New(Config{})
	if isIdle(tel.Tracer) {
		t.Fatal("the tracer over an installed provider is an *idleGlobal")
	}
	tel.Tracer.Start(context.Background(), "job")
}

// A provider given explicitly is used as it is, an SDK's included.
func TestIdleGlobalNotOverAProvider(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tel := New(Config{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	if isIdle(tel.Tracer) {
		t.Fatal("the tracer over an SDK provider is an *idleGlobal")
	}
	if _, s := tel.Tracer.Start(context.Background(), "job"); !s.IsRecording() {
		t.Fatal("a root span of the SDK's records nothing")
	}
}

// TestIdleGlobalProbes checks that a global tracer that makes spans
// without a provider installed (as the eBPF auto-instrumentation makes it)
// is found within probeEvery starts, whether its probe span records or
// only has a trace context (sampled out), and has every span from then
// on. A real SDK tracer stands in for the global tracer.
func TestIdleGlobalProbes(t *testing.T) {
	t.Parallel()
	tp := otel.GetTracerProvider()
	if !isGlobal(tp) {
		t.Skip("a provider is installed in this process")
	}
	for _, sampler := range []sdktrace.Sampler{sdktrace.AlwaysSample(), sdktrace.NeverSample()} {
		rec := tracetest.NewSpanRecorder()
		sdk := sdktrace.NewTracerProvider(sdktrace.WithSampler(sampler), sdktrace.WithSpanProcessor(rec))
		g := &idleGlobal{tr: sdk.Tracer("probe"), tp: tp, span: &idleSpan{tp: tp}}
		bg := context.Background()
		for i := 1; i < probeEvery; i++ {
			if _, s := g.Start(bg, "idle"); s != g.span {
				t.Fatalf("%s: start %d: a span of the global tracer before the probe", sampler.Description(), i)
			}
		}
		if _, s := g.Start(bg, "probe"); !s.SpanContext().IsValid() {
			t.Fatalf("%s: the probe did not start a span of the global tracer", sampler.Description())
		}
		for i := range 3 {
			if _, s := g.Start(bg, "after"); s == g.span {
				t.Fatalf("%s: start %d after the probe found the tracer live: the idle span again", sampler.Description(), i)
			}
		}
		if sampler == sdktrace.AlwaysSample() {
			if n := len(rec.Started()); n != 4 {
				t.Fatalf("the global tracer started %d spans that record, want 4", n)
			}
		}
	}
}
