package telemetry

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Metrics holds leasehold's instruments. Names follow OpenTelemetry; the
// Prometheus exporter turns them into leasehold_* with base units and
// _total suffixes (leasehold.jobs.processed -> leasehold_jobs_processed_total).
type Metrics struct {
	LeasesHeld       metric.Int64UpDownCounter // leasehold_leases_held
	Acquisitions     metric.Int64Counter       // leasehold_lease_acquisitions_total
	Losses           metric.Int64Counter       // leasehold_lease_losses_total{leasehold_reason}
	RenewDuration    metric.Float64Histogram   // leasehold_lease_renew_duration_seconds
	JobsProcessed    metric.Int64Counter       // leasehold_jobs_processed_total
	JobsFailed       metric.Int64Counter       // leasehold_jobs_failed_total
	JobsDeadLettered metric.Int64Counter       // leasehold_jobs_dead_lettered_total
	HandlerDuration  metric.Float64Histogram   // leasehold_handler_duration_seconds
	EffectsEmitted   metric.Int64Counter       // leasehold_effects_emitted_total
	SinkEffects      metric.Int64Counter       // leasehold_sink_effects_total{leasehold_outcome}

	mu     sync.Mutex
	epochs map[int64]int64 // partition -> current epoch held here
	lags   map[int64]int64 // partition -> consumer lag
}

func newMetrics(m metric.Meter) *Metrics {
	ms := &Metrics{epochs: map[int64]int64{}, lags: map[int64]int64{}}
	// Instrument creation fails only for invalid names; these are constant.
	ms.LeasesHeld, _ = m.Int64UpDownCounter("leasehold.leases.held", metric.WithDescription("Partition leases held by this process."), metric.WithUnit("{lease}"))
	ms.Acquisitions, _ = m.Int64Counter("leasehold.lease.acquisitions", metric.WithDescription("Partition leases acquired."), metric.WithUnit("{lease}"))
	ms.Losses, _ = m.Int64Counter("leasehold.lease.losses", metric.WithDescription("Leases lost, by reason (refused, deadline)."), metric.WithUnit("{lease}"))
	ms.RenewDuration, _ = m.Float64Histogram("leasehold.lease.renew.duration", metric.WithDescription("Round trip of a successful lease renewal."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
	ms.JobsProcessed, _ = m.Int64Counter("leasehold.jobs.processed", metric.WithDescription("Jobs handled successfully."), metric.WithUnit("{job}"))
	ms.JobsFailed, _ = m.Int64Counter("leasehold.jobs.failed", metric.WithDescription("Handler attempts that failed (errors and panics)."), metric.WithUnit("{job}"))
	ms.JobsDeadLettered, _ = m.Int64Counter("leasehold.jobs.dead_lettered", metric.WithDescription("Jobs sent to the dead-letter subject."), metric.WithUnit("{job}"))
	ms.HandlerDuration, _ = m.Float64Histogram("leasehold.handler.duration", metric.WithDescription("Time a handler took for one attempt."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30))
	ms.EffectsEmitted, _ = m.Int64Counter("leasehold.effects.emitted", metric.WithDescription("Stamped effects published or applied by handlers."), metric.WithUnit("{effect}"))
	ms.SinkEffects, _ = m.Int64Counter("leasehold.sink.effects", metric.WithDescription("Sink decisions by outcome (accepted, duplicate, rejected_stale, bad_stamp, error)."), metric.WithUnit("{effect}"))

	epoch, _ := m.Int64ObservableGauge("leasehold.partition.epoch", metric.WithDescription("Epoch of each partition lease held by this process."))
	lag, _ := m.Int64ObservableGauge("leasehold.consumer.lag", metric.WithDescription("Jobs waiting in each partition held by this process."), metric.WithUnit("{job}"))
	_, _ = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		ms.mu.Lock()
		defer ms.mu.Unlock()
		for p, e := range ms.epochs {
			o.ObserveInt64(epoch, e, metric.WithAttributes(AttrPartition.Int64(p)))
		}
		for p, l := range ms.lags {
			o.ObserveInt64(lag, l, metric.WithAttributes(AttrPartition.Int64(p)))
		}
		return nil
	}, epoch, lag)
	return ms
}

// SetEpoch records the epoch of a partition held here; 0 forgets it.
func (m *Metrics) SetEpoch(partition, epoch int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if epoch == 0 {
		delete(m.epochs, partition)
		delete(m.lags, partition)
		return
	}
	m.epochs[partition] = epoch
}

// SetLag records how many jobs wait in a partition held here.
func (m *Metrics) SetLag(partition, lag int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, held := m.epochs[partition]; held {
		m.lags[partition] = lag
	}
}

// Outcome is an attribute option for SinkEffects.
func Outcome(o string) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(AttrOutcome.String(o)))
}
