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
//   - once a provider is installed, every span is the global tracer's,
//     which forwards to it;
//   - under a parent with trace context (a job enqueued in a trace), every
//     span is the global tracer's, which carries that context on;
//   - a process whose global tracer records without a provider (the
//     eBPF auto-instrumentation switches it on) is found by a span of
//     the global tracer's every probeEvery starts; from the first that
//     records, every span is the global tracer's.
type idleGlobal struct {
	embedded.Tracer
	tr       trace.Tracer         // the global provider's
	tp       trace.TracerProvider // the global provider, as New found it
	span     trace.Span           // an *idleSpan: compared by pointer
	starts   atomic.Uint64
	recorded atomic.Bool // a span of the global tracer's recorded
}

// probeEvery is how often idleGlobal starts a span of the global tracer's
// all the same, to see whether it records.
const probeEvery = 256

// newIdleGlobal returns tr, the tracer of tp, or an idleGlobal over it
// when tp is the global provider with nothing installed yet.
func newIdleGlobal(tp trace.TracerProvider, tr trace.Tracer) trace.Tracer {
	if tp != otel.GetTracerProvider() || !isGlobalDelegate(tp) {
		return tr
	}
	t := &idleGlobal{tr: tr, tp: tp}
	t.span = &idleSpan{tp: tp}
	return t
}

// isGlobalDelegate reports whether tp is OpenTelemetry's global provider
// before one is installed: otel.GetTracerProvider returns it until then,
// and the provider installed from then on.
func isGlobalDelegate(tp trace.TracerProvider) bool {
	t := reflect.TypeOf(tp)
	return t.Kind() == reflect.Pointer && t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global"
}

func (t *idleGlobal) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if ctx != nil && !t.recorded.Load() && otel.GetTracerProvider() == t.tp && t.starts.Add(1)%probeEvery != 0 {
		parent := trace.SpanFromContext(ctx)
		if !parent.SpanContext().IsValid() {
			if parent == t.span {
				return ctx, parent
			}
			return trace.ContextWithSpan(ctx, t.span), t.span
		}
	}
	ctx, s := t.tr.Start(ctx, name, opts...)
	if s.IsRecording() && !t.recorded.Load() {
		t.recorded.Store(true)
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
