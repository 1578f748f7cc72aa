package sink

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// A sink's spans and metrics go through its Reporter.
//
// A direct sink (Memory, kvsink, pgsink) wraps each Apply in an internal
// span named "apply", a child of the caller's span, so that a handler's
// write shows up under the job's "process" span. A sink that reads a log
// (streamsink, wmsink) wraps each message in a consumer span
// "process <subject template>" whose parent is the span that sent the
// message, taken from the W3C trace context in its headers: a zombie's
// refused effect hangs under the zombie's own "send" span.
//
// Report records each decision on the span its ctx carries (when that span
// was started by the same Reporter) and counts it in
// leasehold_sink_effects_total. A refusal for a stale epoch makes the span
// an error with error.type=stale_epoch, the refused stamp's attributes,
// the partition's maximum and holder, and the event
// leasehold.fence.rejected (see telemetry.RecordStale).
//
// Every drop is traced. One reported under a ctx without a recording span
// of this Reporter gets a span of its own: a child of ctx's span when that
// span records, and otherwise (the zombie's trace was sampled out, or its
// tracer is a no-op) the root of a trace of its own, linked to ctx's span,
// which the sampler decides on as it does on any new trace (the default
// samples them all).

// reporterSpan keys the span a Reporter started in a context.
type reporterSpan struct{}

// spanMark is what a context says about the span a Reporter started in it.
type spanMark struct {
	r      *Reporter
	name   string
	opts   []trace.SpanStartOption
	sender trace.SpanContext // for a message: the span that sent it
}

// markedCtx is a context carrying a span mark under reporterSpan{}, as
// context.WithValue would, in one allocation where WithValue and the mark
// took two: a sink that reads a log starts a span per message.
type markedCtx struct {
	context.Context
	mark spanMark
}

func withMark(ctx context.Context, mark spanMark) context.Context {
	return &markedCtx{Context: ctx, mark: mark}
}

// Value returns the mark, a *spanMark, for reporterSpan{}, and the parent's
// value for any other key.
func (c *markedCtx) Value(key any) any {
	if key == (reporterSpan{}) {
		return &c.mark
	}
	return c.Context.Value(key)
}

// nopSpan is returned when no span is started: ending it ends nothing (a
// non-recording span from the context could be the caller's own).
var nopSpan trace.Span = noop.Span{}

// StartApply starts the span of one Apply of a direct sink, a child of
// ctx's span, and returns the context to report decisions under. Only a
// caller that is itself traced (its span is recording) gets an apply span:
// an untraced Apply costs nothing here, and its drops still get spans of
// their own from Report. End the returned span when Apply returns.
func (r *Reporter) StartApply(ctx context.Context, effects []Effect) (context.Context, trace.Span) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, nopSpan
	}
	ctx, span := r.tel.Tracer.Start(ctx, "apply", r.applyOpts...)
	if len(effects) == 1 {
		span.SetAttributes(telemetry.StampAttrs(effects[0].Stamp)...)
	} else {
		span.SetAttributes(telemetry.AttrEffects.Int(len(effects)))
	}
	return withMark(ctx, spanMark{r: r, name: "apply", opts: r.applyOpts}), span
}

// StartProcess starts the consumer span of one message a sink read from a
// log: "process <subject template>", whose parent is the trace context
// carried by the message (read through carrier, without regard to the
// case of its names) or, when it carries none, ctx's span. stamp is the
// message's stamp as far as it could be read; opts adjust the span (a
// start time, for one). End the span once the decision is reported.
func (r *Reporter) StartProcess(ctx context.Context, carrier propagation.TextMapCarrier, subject string, stamp leasehold.Stamp, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	return r.StartProcessWith(ctx, carrier, subject, stamp, nil, opts...)
}

// StartProcessWith is StartProcess with extra attributes for the span,
// given with the others in one call (the SDK copies each call's).
func (r *Reporter) StartProcessWith(ctx context.Context, carrier propagation.TextMapCarrier, subject string, stamp leasehold.Stamp, extra []attribute.KeyValue, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	ctx = r.tel.Propagator.Extract(ctx, carrier)
	sender := trace.SpanContextFromContext(ctx)
	pn := r.processName(subject, stamp.Partition)
	if len(opts) > 0 {
		opts = append(opts, r.processOpts...)
	} else {
		opts = r.processOpts
	}
	ctx, span := r.tel.Tracer.Start(ctx, pn.name, opts...)
	if span.IsRecording() {
		span.SetAttributes(processAttrs(pn.template, r.name, stamp, extra)...)
	}
	return withMark(ctx, spanMark{r: r, name: pn.name, opts: r.processOpts, sender: sender}), span
}

// processName is the destination template of a process span, and the
// span's name.
type processName struct{ template, name string }

type nameKey struct {
	subject string
	p       leasehold.Partition
}

// maxNames bounds the process names a Reporter keeps: the subjects of a
// sink's partitions, and of anything else published on its log. A subject
// beyond them, or longer than maxNameSubject, has its name made again for
// each message: a stranger publishing long subjects on the log cannot make
// the names kept take more than about 3 MB.
const (
	maxNames       = 4096
	maxNameSubject = 256
)

// processName returns the template and the span name of a message on
// subject of partition p: made once per subject and partition, not for
// each of a log's messages (two strings each).
func (r *Reporter) processName(subject string, p leasehold.Partition) processName {
	k := nameKey{subject, p}
	r.namesMu.Lock()
	pn, ok := r.names[k]
	r.namesMu.Unlock()
	if ok {
		return pn
	}
	pn.template = telemetry.SubjectTemplate(subject, p)
	if subject == "" {
		pn.template = r.name
	}
	pn.name = telemetry.SpanName("process", pn.template)
	r.namesMu.Lock()
	if r.names == nil {
		r.names = make(map[nameKey]processName)
	}
	if len(r.names) < maxNames && len(subject) <= maxNameSubject {
		r.names[k] = pn
	}
	r.namesMu.Unlock()
	return pn
}

// processAttrs are the attributes of a sink's process span: the
// messaging ones a messaging span carries (less the destination's name,
// which is the template with leasehold.partition filled in), the sink, and
// what identifies the write: partition, epoch, writer and key. The
// stamp's scope is in the template's prefix, and a refusal adds it with
// the fence's state (telemetry.RecordStale); the message ID and partition
// ID of the messaging conventions would repeat leasehold.key and
// leasehold.partition. Every attribute costs the SDK and the exporter on
// every message, and a decision adds leasehold.outcome.
func processAttrs(template, sinkName string, stamp leasehold.Stamp, extra []attribute.KeyValue) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, 10+len(extra))
	attrs = append(attrs,
		telemetry.MessagingSystem,
		semconv.MessagingOperationTypeProcess,
		processOperation,
		semconv.MessagingDestinationTemplate(template),
		telemetry.AttrSink.String(sinkName),
	)
	if stamp.Key != "" {
		attrs = append(attrs,
			telemetry.AttrPartition.Int64(int64(stamp.Partition)),
			telemetry.AttrEpoch.Int64(int64(stamp.Epoch)),
			telemetry.AttrKey.String(stamp.Key),
		)
		if stamp.Worker != "" {
			attrs = append(attrs, telemetry.AttrWorker.String(stamp.Worker))
		}
	}
	return append(attrs, extra...)
}

var processOperation = semconv.MessagingOperationName("process")

// Telemetry is the tracer, propagator and instruments the Reporter
// records with, for a sink's spans of its own.
func (r *Reporter) Telemetry() *telemetry.Telemetry { return r.tel }

// traceDecision records d on the span of ctx, or on a span of its own for
// a drop or failure reported outside a recording one.
func (r *Reporter) traceDecision(ctx context.Context, d *Decision) {
	span := trace.SpanFromContext(ctx)
	mark, _ := ctx.Value(reporterSpan{}).(*spanMark)
	if mark != nil && mark.r != r {
		mark = nil
	}
	if mark != nil && span.IsRecording() {
		annotate(span, d)
		return
	}
	if !d.Outcome.Dropped() && d.Outcome != Failed {
		return
	}
	name, opts, link := "apply", r.applyOpts, span.SpanContext()
	if mark != nil {
		name, opts = mark.name, mark.opts
		if mark.sender.IsValid() {
			link = mark.sender // the span of ctx is this sink's own, never recorded
		}
	}
	// The error type goes in at the start, where a sampler sees it
	// (telemetry.KeepRefusals samples every refusal).
	opts = append(opts[:len(opts):len(opts)], trace.WithAttributes(semconv.ErrorTypeKey.String(errorType(d.Outcome))))
	if link.IsValid() && !span.IsRecording() {
		opts = append(opts, trace.WithNewRoot(), trace.WithLinks(trace.Link{SpanContext: link}))
	}
	_, own := r.tel.Tracer.Start(ctx, name, opts...)
	if own.IsRecording() {
		own.SetAttributes(telemetry.StampAttrs(d.Stamp)...)
		own.SetAttributes(telemetry.AttrSink.String(r.name))
		annotate(own, d)
	}
	own.End()
}

func annotate(span trace.Span, d *Decision) {
	if !span.IsRecording() {
		return
	}
	switch d.Outcome {
	case Stale, SplitBrain:
		var se *leasehold.StaleEpochError
		if !errors.As(d.Err, &se) {
			se = leasehold.Refusal(leasehold.FenceState{Epoch: d.Max, Acquisition: d.MaxAcquisition, Holder: d.Holder}, d.Stamp, verdictOf(d.Outcome))
		}
		if se.Holder == "" && d.Holder != "" {
			c := *se
			c.Holder = d.Holder
			se = &c
		}
		telemetry.RecordStale(span, se)
	case Unverified:
		span.SetAttributes(telemetry.AttrMaxEpoch.Int64(int64(d.Max)))
		telemetry.RecordError(span, telemetry.ErrorTypeUnverified, d.Err)
	case BadStamp:
		telemetry.RecordError(span, telemetry.ErrorTypeBadStamp, d.Err)
	case OverLimit:
		telemetry.RecordError(span, telemetry.ErrorTypeOverLimit, d.Err)
	case DeadLettered:
		telemetry.RecordError(span, outcomeDeadLettered, d.Err)
	case Failed:
		telemetry.RecordError(span, "", d.Err)
	}
	span.SetAttributes(telemetry.AttrOutcome.String(outcomeLabel(d.Outcome)))
}

func verdictOf(o Outcome) leasehold.Verdict {
	if o == SplitBrain {
		return leasehold.SplitBrain
	}
	return leasehold.Stale
}

// errorType is the error.type of a drop or failure.
func errorType(o Outcome) string {
	switch o {
	case Stale:
		return telemetry.ErrorTypeStaleEpoch
	case SplitBrain:
		return telemetry.ErrorTypeSplitBrain
	case Unverified:
		return telemetry.ErrorTypeUnverified
	case BadStamp:
		return telemetry.ErrorTypeBadStamp
	case OverLimit:
		return telemetry.ErrorTypeOverLimit
	}
	return telemetry.ErrorTypeOther
}

// outcomeLabel is the leasehold_outcome label of an outcome.
func outcomeLabel(o Outcome) string {
	switch o {
	case Accepted:
		return telemetry.OutcomeAccepted
	case Duplicate:
		return telemetry.OutcomeDuplicate
	case Stale:
		return telemetry.OutcomeRejectedStale
	case SplitBrain:
		return telemetry.OutcomeRejectedSplitBrain
	case Unverified:
		return telemetry.OutcomeRejectedUnverified
	case BadStamp:
		return telemetry.OutcomeRejectedBadStamp
	case OverLimit:
		return telemetry.OutcomeRejectedOverLimit
	case Advanced:
		return telemetry.OutcomeAdvanced
	case DeadLettered:
		return outcomeDeadLettered
	case Aborted:
		return outcomeAborted
	}
	return telemetry.OutcomeError
}

// outcomeDeadLettered is the leasehold_outcome label of the poison path.
const outcomeDeadLettered = "dead_lettered"

// outcomeAborted is the leasehold_outcome label of an effect of a job
// attempt that did not complete.
const outcomeAborted = "aborted"

// newInstruments prepares what the Reporter's spans and counts reuse.
func (r *Reporter) newInstruments(cfg telemetry.Config) {
	r.tel = telemetry.New(cfg)
	sinkAttr := telemetry.AttrSink.String(r.name)
	r.applyOpts = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(sinkAttr)}
	r.processOpts = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	for o := Accepted; o <= Failed; o++ {
		r.counts[o] = telemetry.SinkOutcome(r.name, outcomeLabel(o))
	}
}

// countRefusal counts a drop by scope in leasehold_sink_refusals_total.
// Only a fence of the scope can have refused a stale or split-brain
// effect, so those scopes are bounded by the sink's fences; any other
// drop's stamp may name any scope at all, and counts under "-".
func (r *Reporter) countRefusal(ctx context.Context, d Decision) {
	scope := "-"
	if d.Outcome == Stale || d.Outcome == SplitBrain {
		scope = d.Stamp.Scope
	}
	r.tel.Metrics.SinkRefusals.Add(ctx, 1, metric.WithAttributes(
		telemetry.AttrSink.String(r.name), telemetry.AttrScope.String(scope), telemetry.AttrOutcome.String(outcomeLabel(d.Outcome))))
}

func (r *Reporter) count(ctx context.Context, o Outcome) {
	if int(o) < len(r.counts) && r.counts[o] != nil {
		r.tel.Metrics.SinkEffects.Add(ctx, 1, r.counts[o]...)
	}
}
