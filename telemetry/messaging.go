package telemetry

import (
	"context"
	"errors"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
)

// MessagingSystem is the messaging.system attribute for NATS.
var MessagingSystem = semconv.MessagingSystemKey.String("nats")

// SendAttrs are the messaging attributes of a "send" span to subject, whose
// subject template (such as "orders.out.{partition}") is template.
func SendAttrs(subject, template string) []attribute.KeyValue {
	return []attribute.KeyValue{
		MessagingSystem,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingDestinationName(subject),
		semconv.MessagingDestinationTemplate(template),
	}
}

// processAttrsRoom is the capacity of the slice ProcessAttrs returns, so
// that a caller's own attributes (a sink's name, StampAttrs) land in
// place instead of copying the slice.
const processAttrsRoom = 16

// ProcessAttrs are the messaging attributes of a "process" span, in a
// slice with room for a sink's own.
func ProcessAttrs(subject, template, consumerGroup string) []attribute.KeyValue {
	attrs := append(make([]attribute.KeyValue, 0, processAttrsRoom),
		MessagingSystem,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(subject),
		semconv.MessagingDestinationTemplate(template),
	)
	if consumerGroup != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(consumerGroup))
	}
	return attrs
}

// SpanName is "<operation> <destination template>", as the messaging
// conventions ask: the template, not the subject, keeps span names few.
func SpanName(operation, template string) string { return operation + " " + template }

// SubjectTemplate is subject with its last token replaced by "{partition}"
// when that token is partition p's number, as in every subject leasehold
// names ("orders.jobs.7" becomes "orders.jobs.{partition}"). Other
// subjects are their own template.
func SubjectTemplate(subject string, p leasehold.Partition) string {
	i := strings.LastIndexByte(subject, '.')
	if i < 0 || subject[i+1:] != p.String() {
		return subject
	}
	return subject[:i+1] + "{partition}"
}

// ErrorType classifies err for the error.type attribute: stale_epoch,
// unverified_epoch, bad_stamp, lease_lost, timeout, or _OTHER. Panics are
// the caller's to name (ErrorTypePanic), since this package does not know
// the handler's panic type.
func ErrorType(err error) string {
	switch {
	case errors.Is(err, leasehold.ErrSplitBrain):
		return ErrorTypeSplitBrain
	case errors.Is(err, leasehold.ErrStaleEpoch):
		return ErrorTypeStaleEpoch
	case errors.Is(err, leasehold.ErrBadStamp):
		return ErrorTypeBadStamp
	case errors.Is(err, leasehold.ErrLeaseLost):
		return ErrorTypeLeaseLost
	case errors.Is(err, context.DeadlineExceeded):
		return ErrorTypeTimeout
	}
	return ErrorTypeOther
}

// RecordError marks span failed with err: status Error, error.type
// errorType (ErrorType(err) when empty) and an exception event. A refusal
// for a stale epoch gets RecordStale's attributes and event as well.
func RecordError(span trace.Span, errorType string, err error) {
	if err == nil || !span.IsRecording() {
		return
	}
	var se *leasehold.StaleEpochError
	if errors.As(err, &se) {
		RecordStale(span, se)
		return
	}
	if errorType == "" {
		errorType = ErrorType(err)
	}
	span.SetAttributes(semconv.ErrorTypeKey.String(errorType))
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
}

// RecordStale marks span as a write refused for a stale epoch: status
// Error, error.type=stale_epoch, the attributes leasehold.partition,
// leasehold.epoch (the write's), leasehold.max_epoch, leasehold.worker
// (the writer, when the stamp named it), leasehold.holder (the partition's
// holder, when known) and leasehold.key, and the event
// leasehold.fence.rejected carrying the same attributes, so that the
// refusal can be found by its attributes or its event.
func RecordStale(span trace.Span, e *leasehold.StaleEpochError) {
	if !span.IsRecording() {
		return
	}
	attrs := make([]attribute.KeyValue, 0, 9)
	attrs = append(attrs,
		AttrScope.String(e.Scope),
		AttrPartition.Int64(int64(e.Partition)),
		AttrEpoch.Int64(int64(e.Epoch)),
		AttrMaxEpoch.Int64(int64(e.Max)),
		AttrKey.String(e.Key),
	)
	if e.Worker != "" {
		attrs = append(attrs, AttrWorker.String(e.Worker))
	}
	if e.Holder != "" {
		attrs = append(attrs, AttrHolder.String(e.Holder))
	}
	if e.Acquisition != "" {
		attrs = append(attrs, AttrAcquisition.String(e.Acquisition))
	}
	span.AddEvent(EventFenceRejected, trace.WithAttributes(attrs...))
	errType := ErrorTypeStaleEpoch
	if e.SplitBrain {
		errType = ErrorTypeSplitBrain
	}
	span.SetAttributes(append(attrs, semconv.ErrorTypeKey.String(errType))...)
	span.SetStatus(codes.Error, e.Error())
}
