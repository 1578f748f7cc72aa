package telemetry

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
)

// ScopeName is the instrumentation scope of leasehold's tracers and meters.
const ScopeName = "github.com/leasehold/leasehold"

// Attribute keys leasehold puts on spans and metrics.
const (
	AttrScope       = attribute.Key("leasehold.scope") // the fencing scope: a job stream, or a lock
	AttrAcquisition = attribute.Key("leasehold.acquisition")
	AttrPartition   = attribute.Key("leasehold.partition")
	AttrEpoch       = attribute.Key("leasehold.epoch")     // the epoch a write or lease carries
	AttrMaxEpoch    = attribute.Key("leasehold.max_epoch") // the partition's recorded maximum at a sink
	AttrWorker      = attribute.Key("leasehold.worker")    // the worker that wrote, or holds the lease
	AttrHolder      = attribute.Key("leasehold.holder")    // the current holder of a partition
	AttrKey         = attribute.Key("leasehold.key")       // an effect's idempotency key
	AttrReason      = attribute.Key("leasehold.reason")
	AttrSink        = attribute.Key("leasehold.sink")
	AttrOutcome     = attribute.Key("leasehold.outcome")
	AttrAttempt     = attribute.Key("leasehold.attempt")
	AttrMember      = attribute.Key("leasehold.member")
	AttrSeq         = attribute.Key("leasehold.seq")      // a job's sequence in the job stream
	AttrPosition    = attribute.Key("leasehold.position") // a message's sequence in an effect log
	AttrBarrier     = attribute.Key("leasehold.barrier")  // the message is a barrier
	AttrEffects     = attribute.Key("leasehold.effects")  // effects in one sink call
)

// EventFenceRejected is the span event recorded on a write refused for a
// stale epoch.
const EventFenceRejected = "leasehold.fence.rejected"

// Values of error.type on leasehold's spans.
const (
	ErrorTypeStaleEpoch = "stale_epoch"      // a sink refused a write: its epoch is below the partition's maximum
	ErrorTypeSplitBrain = "split_brain"      // a sink refused a write: its epoch is the fence's, from another acquisition
	ErrorTypeUnverified = "unverified_epoch" // a sink refused an epoch the lease bucket never issued
	ErrorTypeBadStamp   = "bad_stamp"        // a stamp was missing or malformed
	ErrorTypeOverLimit  = "over_limit"       // a sink refused a write that would take it beyond a bound of its own
	ErrorTypeLeaseLost  = "lease_lost"       // the work outlived its lease
	ErrorTypePanic      = "panic"            // a handler panicked
	ErrorTypeTimeout    = "timeout"          // a deadline passed
	ErrorTypeOther      = "_OTHER"           // anything else, as the semantic conventions name it
)

// Config selects the OpenTelemetry providers. Zero fields mean the globals
// (otel.GetTracerProvider, otel.GetMeterProvider and
// otel.GetTextMapPropagator), read when New is called. The global providers
// forward to whatever is installed later, so a component built before
// otel.SetTracerProvider still records into the provider set afterwards.
type Config struct {
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	Propagator     propagation.TextMapPropagator
	// PartitionLabels labels the metrics of the partitions a worker holds
	// (leasehold_partition_epoch, leasehold_consumer_lag,
	// leasehold_partition_stalled, leasehold_jobs_hung_total) with the
	// partition and the worker (leasehold_partition and leasehold_worker,
	// and OpenTelemetry's messaging_destination_partition_id and
	// messaging_client_id), and leasehold_effect_subjects_unavailable with
	// the worker: a series per partition and worker. Off by default:
	// with thousands of partitions and pod-named workers that is the
	// cardinality Prometheus warns of, so each is one series per process
	// (the lag and the stalled partitions summed; the epochs are not
	// exported). Spans carry the partition and the worker either way.
	PartitionLabels bool
}

// Telemetry bundles a tracer, the metric instruments and the propagator
// leasehold's packages share. Build it with New (or Setup); its fields are
// read-only.
type Telemetry struct {
	Tracer     trace.Tracer
	Propagator propagation.TextMapPropagator
	Metrics    *Metrics

	cfg Config
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
		Tracer:     newIdleGlobal(cfg.TracerProvider, cfg.TracerProvider.Tracer(ScopeName)), // idleglobal.go
		Propagator: cfg.Propagator,
		Metrics:    newMetrics(cfg.MeterProvider.Meter(ScopeName), cfg.PartitionLabels),
		cfg:        cfg,
	}
}

// Config returns the providers t was built from, for handing to the
// Telemetry field of a worker, producer or sink configuration.
func (t *Telemetry) Config() Config { return t.cfg }

// StampAttrs are the attributes that identify a stamped write.
func StampAttrs(s leasehold.Stamp) []attribute.KeyValue {
	attrs := append(make([]attribute.KeyValue, 0, 5), // with the worker's
		AttrScope.String(s.Scope),
		AttrPartition.Int64(int64(s.Partition)),
		AttrEpoch.Int64(int64(s.Epoch)),
		AttrKey.String(s.Key),
	)
	if s.Worker != "" {
		attrs = append(attrs, AttrWorker.String(s.Worker))
	}
	return attrs
}
