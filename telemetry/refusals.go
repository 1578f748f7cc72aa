package telemetry

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
)

// refusalQueue is how many ended spans of refused writes wait for export
// before more are dropped: at about a kilobyte each, 64 MiB at most, and
// only while a zombie is refused faster than the collector takes them.
const refusalQueue = 65536

// refusalsApart is the span processor Setup exports through: the SDK's
// batcher for every span, and a second batcher, with a queue of its own,
// for the spans of refused writes. A batcher drops what does not fit its
// queue (2048 spans unless OTEL_BSP_MAX_QUEUE_SIZE says otherwise), and
// with every trace sampled a busy worker fleet ends spans faster than one
// exporter drains them: the refusals, the spans an engineer chasing a
// zombie needs, must not be what is dropped.
type refusalsApart struct {
	all, refusals sdktrace.SpanProcessor
}

func newRefusalsApart(exp sdktrace.SpanExporter) refusalsApart {
	return refusalsApart{
		all:      sdktrace.NewBatchSpanProcessor(exp),
		refusals: sdktrace.NewBatchSpanProcessor(borrowedExporter{exp}, sdktrace.WithMaxQueueSize(refusalQueue)),
	}
}

func (p refusalsApart) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

func (p refusalsApart) OnEnd(s sdktrace.ReadOnlySpan) {
	if isRefusal(s) {
		p.refusals.OnEnd(s)
		return
	}
	p.all.OnEnd(s)
}

// Shutdown flushes the refusals first: the other batcher shuts the
// exporter down.
func (p refusalsApart) Shutdown(ctx context.Context) error {
	return errors.Join(p.refusals.Shutdown(ctx), p.all.Shutdown(ctx))
}

func (p refusalsApart) ForceFlush(ctx context.Context) error {
	return errors.Join(p.refusals.ForceFlush(ctx), p.all.ForceFlush(ctx))
}

// isRefusal reports whether s is the span of a refused write: an error
// whose error.type says a stale epoch or a split brain. The status is
// checked first, so that other spans cost no look at their attributes.
func isRefusal(s sdktrace.ReadOnlySpan) bool {
	if s.Status().Code != codes.Error {
		return false
	}
	for _, a := range s.Attributes() {
		if a.Key == semconv.ErrorTypeKey {
			v := a.Value.AsString()
			return v == ErrorTypeStaleEpoch || v == ErrorTypeSplitBrain
		}
	}
	return false
}

// borrowedExporter is an exporter shared with another batcher, which
// shuts it down.
type borrowedExporter struct{ sdktrace.SpanExporter }

func (borrowedExporter) Shutdown(context.Context) error { return nil }
