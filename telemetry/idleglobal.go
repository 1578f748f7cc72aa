package telemetry

import (
	"context"
	"reflect"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"
)

// idleGlobal is the tracer New hands out over OpenTelemetry's global
// provider while no provider is installed (otel.SetTracerProvider), which
// is how a program that does not trace runs. The global tracer's spans
// record nothing then, and each still cost two allocations: the span,
// and the context that carries it. A job pays for three (its enqueue,
// its attempt and its effect's application), about 5% of the allocations
// of the whole end-to-end pipeline. Under a parent that carries no trace
// context, idleGlobal hands out one span of its own instead, boxed once,
// which records nothing either and names the global provider, as the
// global's own span does; under its own span it adds nothing to the
// context at all.
//
// What is recorded is the same:
//   - under a parent with trace context (a job enqueued in a trace), every
//     span is the global tracer's, which carries that context on;
//   - once a provider is installed, every span is the global tracer's,
//     which forwards to it: from the first start that finds
//     otel.GetTracerProvider changed, or, for a provider installed and
//     then replaced by the global again between two starts (the global
//     forwards to the first provider installed, whatever is installed
//     after it), from the first probe;
//   - a global tracer that makes spans without a provider (the eBPF
//     auto-instrumentation switches it on) is found by the probe as well.
//
// The probe is a span of the global tracer's, every probeEvery starts
// under a parent without trace context: a span that records, or has a
// trace context of its own (sampled or not), shows the global tracer is
// live, and every span is its from then on. Until then, at most
// probeEvery-1 such spans are missed.
type idleGlobal struct {
	embedded.Tracer
	tr     trace.Tracer         // the global provider's
	tp     trace.TracerProvider // the global provider, as New found it
	span   trace.Span           // an *idleSpan: compared by pointer
	starts atomic.Uint64
	live   atomic.Bool // the global tracer makes spans: pass every start to it
}

// probeEvery is how often idleGlobal starts a span of the global tracer's
// all the same, to see whether it makes spans.
const probeEvery = 256

// newIdleGlobal returns tr, the tracer of tp, or an idleGlobal over it
// when tp is the global provider with nothing installed yet.
func newIdleGlobal(tp trace.TracerProvider, tr trace.Tracer) trace.Tracer {
	// The type checks come first: comparing two providers of a type that
	// is not comparable (a struct holding a slice) panics.
	if !isGlobal(tp) || !isGlobal(tr) || tp != otel.GetTracerProvider() {
		// Not the global provider; or its tracer is an installed
		// provider's already (the global forwards to the first one
		// installed, whatever is installed after it); or a provider is
		// installed now.
		return tr
	}
	t := &idleGlobal{tr: tr, tp: tp}
	t.span = &idleSpan{tp: tp}
	return t
}

// isGlobal reports whether v (a provider or a tracer) is one of
// OpenTelemetry's global delegating ones, which otel.GetTracerProvider
// hands out until a provider is installed.
func isGlobal(v any) bool {
	t := reflect.TypeOf(v)
	return t != nil && t.Kind() == reflect.Pointer && t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global"
}

func (t *idleGlobal) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if ctx == nil || t.live.Load() {
		return t.tr.Start(ctx, name, opts...)
	}
	if otel.GetTracerProvider() != t.tp { // t.tp is a pointer: this cannot panic
		t.live.Store(true)
		return t.tr.Start(ctx, name, opts...)
	}
	parent := trace.SpanFromContext(ctx)
	if parent.SpanContext().IsValid() {
		return t.tr.Start(ctx, name, opts...)
	}
	if t.starts.Add(1)%probeEvery != 0 {
		if parent == t.span {
			return ctx, parent
		}
		return trace.ContextWithSpan(ctx, t.span), t.span
	}
	ctx, s := t.tr.Start(ctx, name, opts...)
	if s.IsRecording() || s.SpanContext().IsValid() {
		// Under a parent without trace context, the idle global tracer's
		// span has none either.
		t.live.Store(true)
	}
	return ctx, s
}

// idleSpan records nothing and carries no trace context, as the global
// tracer's spans do while no provider is installed, and names the global
// provider, so that instrumentation taking a tracer from the span in a
// context (Span.TracerProvider) gets the one that forwards to a provider
// installed later.
type idleSpan struct {
	noop.Span
	tp trace.TracerProvider
}

func (s *idleSpan) TracerProvider() trace.TracerProvider { return s.tp }
