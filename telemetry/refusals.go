package telemetry

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
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
//
// Each batcher sits behind a countedQueue, so that every span lost on the
// way is counted in leasehold_trace_spans_dropped_total: the batcher
// itself drops a span silently.
type refusalsApart struct {
	all, refusals *countedQueue
}

func newRefusalsApart(exp sdktrace.SpanExporter, meter metric.Meter) refusalsApart {
	drops, _ := meter.Int64Counter("leasehold.trace.spans.dropped",
		metric.WithDescription("Sampled spans never exported: the export queue was full (leasehold_reason=queue_full; OTEL_BSP_MAX_QUEUE_SIZE sets its size) "+
			"or the exporter gave up on them (export_failed). leasehold_queue=refusals counts the spans of refused writes, which have a queue of their own."),
		metric.WithUnit("{span}"))
	return refusalsApart{
		all:      newCountedQueue(exp, envQueueSize(), "spans", drops),
		refusals: newCountedQueue(borrowedExporter{exp}, refusalQueue, "refusals", drops),
	}
}

// envQueueSize is the batcher's queue size: OTEL_BSP_MAX_QUEUE_SIZE when
// it is a positive number, else the SDK's default. (Given 0, the SDK would
// make a queue that holds nothing, and a negative size would panic.)
func envQueueSize() int {
	if n, err := strconv.Atoi(strings.TrimSpace(os.Getenv("OTEL_BSP_MAX_QUEUE_SIZE"))); err == nil && n > 0 {
		return n
	}
	return sdktrace.DefaultMaxQueueSize
}

// countedQueue hands sampled spans to a batcher while fewer than max of
// the spans it was handed have not reached the exporter yet, and counts
// the others as dropped. Those spans are in the batcher's queue or the
// batch it is filling, so its queue, which holds max, never overflows,
// and the count is exact: the batcher's own drops are silent.
type countedQueue struct {
	next    sdktrace.SpanProcessor
	max     int64
	pending atomic.Int64 // handed to next, not yet given to the exporter
	drops   metric.Int64Counter
	full    metric.MeasurementOption
	failed  metric.MeasurementOption
}

func newCountedQueue(exp sdktrace.SpanExporter, size int, queue string, drops metric.Int64Counter) *countedQueue {
	q := &countedQueue{
		max:    int64(size),
		drops:  drops,
		full:   metric.WithAttributeSet(attribute.NewSet(AttrReason.String("queue_full"), attrQueue.String(queue))),
		failed: metric.WithAttributeSet(attribute.NewSet(AttrReason.String("export_failed"), attrQueue.String(queue))),
	}
	q.next = sdktrace.NewBatchSpanProcessor(countingExporter{SpanExporter: exp, q: q}, sdktrace.WithMaxQueueSize(size))
	return q
}

var attrQueue = attribute.Key("leasehold.queue")

func (q *countedQueue) OnEnd(s sdktrace.ReadOnlySpan) {
	if !s.SpanContext().IsSampled() {
		return // a batcher exports sampled spans only
	}
	if q.pending.Add(1) > q.max {
		q.pending.Add(-1)
		q.drops.Add(context.Background(), 1, q.full)
		return
	}
	q.next.OnEnd(s)
}

func (q *countedQueue) Shutdown(ctx context.Context) error   { return q.next.Shutdown(ctx) }
func (q *countedQueue) ForceFlush(ctx context.Context) error { return q.next.ForceFlush(ctx) }

// countingExporter tells its queue which spans reached the exporter, and
// counts those the exporter failed to deliver.
type countingExporter struct {
	sdktrace.SpanExporter
	q *countedQueue
}

func (e countingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.q.pending.Add(-int64(len(spans)))
	err := e.SpanExporter.ExportSpans(ctx, spans)
	if err != nil {
		e.q.drops.Add(context.Background(), int64(len(spans)), e.q.failed)
	}
	return err
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
