package worker

import (
	"context"
	"errors"
	"fmt"

	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

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
//     child. Dead letters get one too.
//   - "partition fence" (internal, a root): the fences and barriers
//     written when the worker acquires a partition, with a "fence advance"
//     child per fence and a "send" child per barrier.
//
// Lease events are root spans of their own (telemetry.LeaseObserver).
// Attributes that are the same for every job of a partition are computed
// once per runner; the rest only for spans that record.

// spans holds what a runner's spans share.
type spans struct {
	processName string
	processOpts []trace.SpanStartOption
	outputSend  string // the span name of a send to the default output
}

// sendOpts are the start options of every "send" span.
var sendOpts = []trace.SpanStartOption{
	trace.WithSpanKind(trace.SpanKindProducer),
	trace.WithAttributes(telemetry.MessagingSystem, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("send")),
}

func newSpans(r *runner) spans {
	template := telemetry.SubjectTemplate(r.subject, r.p)
	attrs := append(telemetry.ProcessAttrs(r.subject, template, r.w.cfg.Prefix),
		semconv.MessagingDestinationPartitionID(r.p.String()),
		telemetry.AttrPartition.Int64(int64(r.p)),
		telemetry.AttrEpoch.Int64(int64(r.info.Epoch)),
		telemetry.AttrWorker.String(r.info.Holder),
	)
	return spans{
		processName: telemetry.SpanName("process", template),
		processOpts: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...)},
		outputSend:  telemetry.SpanName("send", telemetry.SubjectTemplate(r.output, r.p)),
	}
}

// startProcess starts the span of one attempt at job, the child of the
// span in ctx (the enqueue's, extracted from the job's headers).
func (r *runner) startProcess(ctx context.Context, job *Job) (context.Context, trace.Span) {
	ctx, span := r.w.tel.Tracer.Start(ctx, r.spans.processName, r.spans.processOpts...)
	if span.IsRecording() {
		span.SetAttributes(
			semconv.MessagingMessageID(job.ID),
			telemetry.AttrSeq.Int64(int64(job.Seq)),
			telemetry.AttrAttempt.Int(job.Attempt),
		)
	}
	return ctx, span
}

// endSpan records err on span, if any, and ends it.
func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		typ := ""
		var pe *PanicError
		if errors.As(err, &pe) {
			typ = telemetry.ErrorTypePanic
		}
		telemetry.RecordError(span, typ, err)
	}
	span.End()
}

// startSend starts the span of a message sent to subject under stamp s:
// an effect, a dead letter or a barrier.
func (r *runner) startSend(ctx context.Context, subject string, s leasehold.Stamp) (context.Context, trace.Span) {
	name := r.spans.outputSend
	if subject != r.output {
		name = telemetry.SpanName("send", telemetry.SubjectTemplate(subject, r.p))
	}
	ctx, span := r.w.tel.Tracer.Start(ctx, name, sendOpts...)
	if span.IsRecording() {
		span.SetAttributes(
			semconv.MessagingDestinationName(subject),
			semconv.MessagingDestinationTemplate(name[len("send "):]),
			semconv.MessagingDestinationPartitionID(r.p.String()),
			semconv.MessagingMessageID(s.Key),
			telemetry.AttrPartition.Int64(int64(s.Partition)),
			telemetry.AttrEpoch.Int64(int64(s.Epoch)),
			telemetry.AttrKey.String(s.Key),
			telemetry.AttrWorker.String(s.Worker),
		)
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
