package telemetry

import (
	"context"
	"strings"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
)

// followsParent reports whether s decides no span whose parent was not
// sampled is sampled, remote parent or local: a parent-based sampler
// whose two "parent not sampled" samplers are AlwaysOff, as
// DefaultSampler and OTEL_TRACES_SAMPLER=parentbased_* are. It reads the
// SDK's description of the sampler, whose format the specification fixes;
// any other sampler, or another format, is not known to follow.
// KeepRefusals over such a sampler follows it too for every span started
// without attributes, which are the only spans parentDecides decides on.
func followsParent(s sdktrace.Sampler) bool {
	if k, ok := s.(keepRefusals); ok {
		return followsParent(k.base)
	}
	d := s.Description()
	return strings.HasPrefix(d, "ParentBased{") &&
		strings.Contains(d, ",remoteParentNotSampled:AlwaysOffSampler,") &&
		strings.HasSuffix(d, ",localParentNotSampled:AlwaysOffSampler}")
}

// parentDecides is the tracer provider Setup hands out when its sampler
// follows the parent (followsParent): its tracers start no SDK span under
// a parent that was not sampled, since the sampler would drop it, and
// return the parent's own span, which records nothing and carries the
// same trace context on. Most of a pipeline's jobs are in traces that
// were not sampled (nine in ten with DefaultSampler), and each would
// otherwise pay the SDK for a span ID, two sampler calls and three
// allocations in the worker and again in a sink, for nothing anyone sees.
// What is recorded is the same: a span started with attributes or links,
// or as a new root, is the SDK's to decide on (KeepRefusals samples a
// refusal by its error.type, given at the start), and so is every span
// under a sampled parent or none. The one difference is in trace context
// nobody records: an effect of an unsampled job carries its enqueue's span
// ID rather than that of an attempt span that was never recorded.
type parentDecides struct {
	embedded.TracerProvider
	tp trace.TracerProvider
}

// ForceFlush exports the spans ended so far, as the SDK's provider's
// ForceFlush does: code that asserted Setup's provider to a flusher still
// finds one.
func (p *parentDecides) ForceFlush(ctx context.Context) error {
	if f, ok := p.tp.(interface{ ForceFlush(context.Context) error }); ok {
		return f.ForceFlush(ctx)
	}
	return nil
}

func (p *parentDecides) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	return parentDecidesTracer{tr: p.tp.Tracer(name, opts...), tp: p}
}

type parentDecidesTracer struct {
	embedded.Tracer
	tr trace.Tracer
	tp *parentDecides
}

func (t parentDecidesTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if ctx != nil {
		if parent := trace.SpanFromContext(ctx); !parent.IsRecording() && parent.SpanContext().IsValid() && !parent.SpanContext().IsSampled() {
			if c := trace.NewSpanStartConfig(opts...); !c.NewRoot() && len(c.Attributes()) == 0 && len(c.Links()) == 0 {
				if u, ok := parent.(unsampledSpan); ok && u.tp == t.tp {
					return ctx, parent
				}
				var s trace.Span = unsampledSpan{Span: parent, tp: t.tp} // boxed once
				return trace.ContextWithSpan(ctx, s), s
			}
		}
	}
	return t.tr.Start(ctx, name, opts...)
}

// unsampledSpan is a parent that was not sampled, standing in for its
// child: it records nothing, carries the parent's context, and names
// the provider that started it, so that instrumentation taking a tracer
// from the span in a context (Span.TracerProvider) still gets Setup's.
type unsampledSpan struct {
	trace.Span
	tp *parentDecides
}

func (s unsampledSpan) TracerProvider() trace.TracerProvider { return s.tp }

// End ends nothing: the span is not this child's.
func (unsampledSpan) End(...trace.SpanEndOption) {}
