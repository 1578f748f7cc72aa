package telemetry

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
)

// ScopeName is the instrumentation scope of leasehold's tracers and meters.
const ScopeName = "github.com/leasehold/leasehold"

// Attribute keys leasehold puts on spans and metrics.
const (
	AttrPartition = attribute.Key("leasehold.partition")
	AttrEpoch     = attribute.Key("leasehold.epoch")
	AttrMaxEpoch  = attribute.Key("leasehold.max_epoch")
	AttrWorker    = attribute.Key("leasehold.worker")
	AttrHolder    = attribute.Key("leasehold.holder") // the current holder of a partition
	AttrKey       = attribute.Key("leasehold.key")    // an effect's idempotency key
	AttrReason    = attribute.Key("leasehold.reason")
	AttrSink      = attribute.Key("leasehold.sink")
	AttrOutcome   = attribute.Key("leasehold.outcome")
	AttrAttempt   = attribute.Key("leasehold.attempt")
	AttrMember    = attribute.Key("leasehold.member")
)

// EventFenceRejected is the span event recorded on a write refused for a
// stale epoch.
const EventFenceRejected = "leasehold.fence.rejected"

// ErrorTypeStaleEpoch is the error.type of a refused zombie write.
const ErrorTypeStaleEpoch = "stale_epoch"

// MessagingSystem is the messaging.system attribute for NATS.
var MessagingSystem = semconv.MessagingSystemKey.String("nats")

// Config selects the OpenTelemetry providers. Zero fields mean the globals
// (otel.GetTracerProvider and so on), read when New is called.
type Config struct {
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	Propagator     propagation.TextMapPropagator
}

// Telemetry bundles a tracer, the metric instruments and the propagator
// leasehold's packages share.
type Telemetry struct {
	Tracer     trace.Tracer
	Propagator propagation.TextMapPropagator
	Metrics    *Metrics
}

// New builds the tracer and instruments from cfg.
func New(cfg Config) *Telemetry {
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	if cfg.MeterProvider == nil {
		cfg.MeterProvider = otel.GetMeterProvider()
	}
	if cfg.Propagator == nil {
		cfg.Propagator = otel.GetTextMapPropagator()
	}
	return &Telemetry{
		Tracer:     cfg.TracerProvider.Tracer(ScopeName),
		Propagator: cfg.Propagator,
		Metrics:    newMetrics(cfg.MeterProvider.Meter(ScopeName)),
	}
}

// StampAttrs are the attributes that identify a stamped write.
func StampAttrs(s leasehold.Stamp) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		AttrPartition.Int64(int64(s.Partition)),
		AttrEpoch.Int64(int64(s.Epoch)),
		AttrKey.String(s.Key),
	}
	if s.Worker != "" {
		attrs = append(attrs, AttrWorker.String(s.Worker))
	}
	return attrs
}

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

// ProcessAttrs are the messaging attributes of a "process" span.
func ProcessAttrs(subject, template, consumerGroup string) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		MessagingSystem,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(subject),
		semconv.MessagingDestinationTemplate(template),
	}
	if consumerGroup != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(consumerGroup))
	}
	return attrs
}

// SpanName is "<operation> <destination template>", as the messaging
// conventions ask: the template, not the subject, keeps span names few.
func SpanName(operation, template string) string { return operation + " " + template }
