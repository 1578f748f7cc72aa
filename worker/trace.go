package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
)

// A worker's spans follow the OpenTelemetry messaging conventions:
//
//   - "send <prefix>.jobs.{partition}" (producer): a Producer's enqueue;
//     its context travels in the job's headers.
//   - "process <prefix>.jobs.{partition}" (consumer): one attempt at a
//     job, the child of the enqueue's span.
//   - "send <subject template>" (producer): an effect Job.Publish or
//     Job.Emit sends, the child of the attempt's span; its context travels
//     in the effect's headers, so a sink's span for the effect is its
//     child. Dead letters get one too. Only an attempt whose trace is
//     sampled (its span records) gets effect spans: under a trace that was
//     not, a send span would record nothing, and the effect carries the
//     attempt's context, which says the trace was not sampled, as well.
//   - "partition fence" (internal, a root): the fences and barriers
//     written when the worker acquires a partition, with a "fence advance"
//     child per fence and a "send" child per barrier.
//
// Lease events are root spans of their own (telemetry.LeaseObserver).
// Attributes that are the same for every job of a partition are computed
// once per runner; the rest only for spans that record.

// spans holds what a runner's spans share: names, kinds and the
// attributes that are the same for every job and effect of the partition.
//
// The SDK's cost grows with every attribute and every copy of them, and
// jumps past eight attributes (its de-duplication map outgrows one
// group), so a job's spans carry eight: the messaging attributes, and the
// leasehold ones a search needs. A process span leaves out
// messaging.destination.name, which is its template with the partition
// filled in; a send span leaves out leasehold.partition, which its
// destination names. They get them in one SetAttributes call right after
// Start, which the SDK copies once (options given to Start are copied
// twice, and a second SetAttributes grows the span's slice again), so
// samplers see the span's name and kind, not its attributes.
type spans struct {
	processName string
	outputName  string // a send to the default output
	// The attributes are made for the first span that records: a worker
	// holds many partitions, and with tracing off none needs them.
	attrsOnce    sync.Once
	processAttrs []attribute.KeyValue
	outputAttrs  []attribute.KeyValue
}

var (
	consumerSpan = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	producerSpan = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer)}
)

// initSpans names r's spans.
func (r *runner) initSpans() {
	r.spans.processName = telemetry.SpanName("process", telemetry.SubjectTemplate(r.subject, r.p))
	r.spans.outputName = telemetry.SpanName("send", telemetry.SubjectTemplate(r.output, r.p))
}

// spanAttrs returns the attributes r's process spans and its sends to the
// default output share, made on the first call.
func (r *runner) spanAttrs() (process, output []attribute.KeyValue) {
	s := &r.spans
	s.attrsOnce.Do(func() {
		template := telemetry.SubjectTemplate(r.subject, r.p)
		s.processAttrs = []attribute.KeyValue{
			telemetry.MessagingSystem,
			semconv.MessagingOperationTypeProcess,
			semconv.MessagingOperationName("process"),
			semconv.MessagingDestinationTemplate(template),
			telemetry.AttrPartition.Int64(int64(r.p)),
			telemetry.AttrEpoch.Int64(int64(r.info.Epoch)),
			telemetry.AttrWorker.String(r.info.Holder),
			// The messaging conventions' names for the same.
			semconv.MessagingDestinationPartitionID(r.p.String()),
			semconv.MessagingClientID(r.info.Holder),
		}
		_, s.outputAttrs = r.sendSpan(r.output)
	})
	return s.processAttrs, s.outputAttrs
}

// sendSpan returns the name and attributes of a send to subject.
func (r *runner) sendSpan(subject string) (string, []attribute.KeyValue) {
	template := telemetry.SubjectTemplate(subject, r.p)
	return telemetry.SpanName("send", template), append(telemetry.SendAttrs(subject, template),
		telemetry.AttrEpoch.Int64(int64(r.info.Epoch)),
		telemetry.AttrWorker.String(r.info.Holder),
	)
}

// attrScratch holds the slices setAttributes joins a span's attributes
// in: the SDK copies what SetAttributes is given, so the joined slice is
// garbage once the call returns, one per span.
var attrScratch = sync.Pool{New: func() any {
	s := make([]attribute.KeyValue, 0, 12)
	return &s
}}

// setAttributes gives a recording span its attributes in one call.
func setAttributes(span trace.Span, shared []attribute.KeyValue, own ...attribute.KeyValue) {
	if !span.IsRecording() {
		return
	}
	p := attrScratch.Get().(*[]attribute.KeyValue)
	attrs := append(append((*p)[:0], shared...), own...)
	span.SetAttributes(attrs...)
	clear(attrs) // the pool keeps no strings alive
	*p = attrs[:0]
	attrScratch.Put(p)
}

// nopSpan stands for a span not started: ending it ends nothing.
var nopSpan trace.Span = noop.Span{}

// startProcess starts the span of one attempt at job, the child of the
// span in ctx (the enqueue's, extracted from the job's headers).
func (r *runner) startProcess(ctx context.Context, job *Job) (context.Context, trace.Span) {
	ctx, span := r.w.tel.Tracer.Start(ctx, r.spans.processName, consumerSpan...)
	if !span.IsRecording() {
		return ctx, span
	}
	attrs, _ := r.spanAttrs()
	if job.Attempt > 1 {
		setAttributes(span, attrs, telemetry.AttrSeq.Int64(int64(job.Seq)), telemetry.AttrAttempt.Int(job.Attempt))
	} else {
		setAttributes(span, attrs, telemetry.AttrSeq.Int64(int64(job.Seq)))
	}
	return ctx, span
}

// endSpan records err on span, if any, and ends it. A handler's panic
// keeps its stack here (exception.stacktrace), not in the error's
// one-line message.
func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		var pe *PanicError
		if errors.As(err, &pe) {
			span.SetAttributes(semconv.ErrorTypeKey.String(telemetry.ErrorTypePanic))
			span.RecordError(err, trace.WithAttributes(semconv.ExceptionStacktrace(string(pe.Stack))))
			span.SetStatus(codes.Error, err.Error())
		} else {
			telemetry.RecordError(span, "", err)
		}
	}
	span.End()
}

// startEffect starts the span of an effect sent to subject under stamp s,
// when ctx's span records (the attempt's, or a handler's own span under
// it); otherwise it returns ctx, whose trace context the effect carries,
// and a span that records nothing.
func (r *runner) startEffect(ctx context.Context, subject string, s leasehold.Stamp) (context.Context, trace.Span) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, nopSpan
	}
	return r.startSend(ctx, subject, s)
}

// startSend starts the span of a message sent to subject under stamp s
// (an effect, a dead letter or a barrier); its message ID is the stamp's
// key.
func (r *runner) startSend(ctx context.Context, subject string, s leasehold.Stamp) (context.Context, trace.Span) {
	if subject != r.output {
		name, attrs := r.sendSpan(subject)
		ctx, span := r.w.tel.Tracer.Start(ctx, name, producerSpan...)
		setAttributes(span, attrs, semconv.MessagingMessageID(s.Key))
		return ctx, span
	}
	ctx, span := r.w.tel.Tracer.Start(ctx, r.spans.outputName, producerSpan...)
	if span.IsRecording() {
		_, attrs := r.spanAttrs()
		setAttributes(span, attrs, semconv.MessagingMessageID(s.Key))
	}
	return ctx, span
}

// startFence starts the root span of writing a partition's fences and
// barriers; its context is r.ctx's, so that it ends with the lease.
func (r *runner) startFence() (context.Context, trace.Span) {
	return r.w.tel.Tracer.Start(r.ctx, "partition fence",
		trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			telemetry.AttrPartition.Int64(int64(r.p)),
			telemetry.AttrEpoch.Int64(int64(r.info.Epoch)),
			telemetry.AttrWorker.String(r.info.Holder),
		))
}

// startAdvance starts the span of advancing one fence.
func (r *runner) startAdvance(ctx context.Context, f Fence) (context.Context, trace.Span) {
	ctx, span := r.w.tel.Tracer.Start(ctx, "fence advance", trace.WithSpanKind(trace.SpanKindInternal))
	if span.IsRecording() {
		span.SetAttributes(
			telemetry.AttrSink.String(fmt.Sprintf("%T", f)),
			telemetry.AttrPartition.Int64(int64(r.p)),
			telemetry.AttrEpoch.Int64(int64(r.info.Epoch)),
		)
	}
	return ctx, span
}

// leaseObservers hands each lease event to every observer, in order.
type leaseObservers []coordinator.Observer

func (os leaseObservers) LeaseEvent(ctx context.Context, e coordinator.Event) {
	for _, o := range os {
		o.LeaseEvent(ctx, e)
	}
}
