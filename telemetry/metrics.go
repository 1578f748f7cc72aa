package telemetry

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/leasehold/leasehold"
)

// Metrics holds leasehold's instruments. Names follow OpenTelemetry; the
// Prometheus exporter turns them into leasehold_* names with base units
// and _total suffixes (leasehold.jobs.processed becomes
// leasehold_jobs_processed_total, leasehold.handler.duration in seconds
// becomes leasehold_handler_duration_seconds). The comments give the
// Prometheus names and labels.
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
	// EffectsPreempted counts effects the stream answered as duplicates of
	// a message that is not theirs: leasehold_effects_preempted_total.
	EffectsPreempted metric.Int64Counter
	// SinkEffects counts sink decisions by sink and outcome:
	// leasehold_sink_effects_total{leasehold_sink, leasehold_outcome}, the
	// outcome one of the Outcome* constants.
	SinkEffects metric.Int64Counter
	// SinkRefusals counts the effects a sink refused for good, by the
	// scope whose fence refused them:
	// leasehold_sink_refusals_total{leasehold_sink, leasehold_scope,
	// leasehold_outcome}. Only stale and split-brain refusals carry their
	// scope (a fence of that scope judged them, so the scopes are those the
	// sink keeps fences for); the others, whose stamp may name anything,
	// count under the scope "-".
	SinkRefusals metric.Int64Counter
	// EffectsNoStream counts the effects a worker refused at once because
	// no stream stores their subject (an open subject breaker):
	// leasehold_effects_no_stream_total. The worker's log names the
	// subject; a label would not be bounded.
	EffectsNoStream metric.Int64Counter
	// JobsHung counts handlers that did not return after their context
	// ended, whose partition the worker gave up: leasehold_jobs_hung_total,
	// by partition and worker with Config.PartitionLabels (record it with
	// PartitionAttrs).
	JobsHung metric.Int64Counter
	// JobsInFlight is the jobs whose attempts run now in the workers of
	// this process, over all the partitions they hold:
	// leasehold_jobs_in_flight.
	JobsInFlight metric.Int64UpDownCounter

	meter  metric.Meter
	labels bool      // Config.PartitionLabels: a series per partition and worker
	once   sync.Once // registers the gauges' callback on first use

	mu      sync.Mutex
	epochs  map[held]int64 // current epoch of each partition held here
	lags    map[held]int64 // jobs waiting in each partition held here
	stalled map[held]bool  // partitions held here that are stalled
	// unavailable counts, per worker, the effect subjects found without a
	// stream.
	unavailable map[string]int64

	sinkOnce sync.Once       // registers the sink gauges' callback on first use
	gaps     map[string]bool // sinks of this process stopped at a gap in their log
}

// held names a partition lease held by a worker of this process.
type held struct {
	worker    string
	partition leasehold.Partition
}

// Outcomes of a sink decision, as the leasehold_outcome label of
// leasehold_sink_effects_total spells them.
const (
	OutcomeAccepted           = "accepted"
	OutcomeDuplicate          = "duplicate"
	OutcomeRejectedStale      = "rejected_stale"
	OutcomeRejectedSplitBrain = "rejected_split_brain"
	OutcomeRejectedUnverified = "rejected_unverified"
	OutcomeRejectedBadStamp   = "rejected_bad_stamp"
	OutcomeRejectedOverLimit  = "rejected_over_limit"
	OutcomeAdvanced           = "advanced" // a barrier or Advance raised a partition's maximum
	OutcomeError              = "error"
)

func newMetrics(m metric.Meter, labels bool) *Metrics {
	ms := &Metrics{meter: m, labels: labels, epochs: map[held]int64{}, lags: map[held]int64{}, stalled: map[held]bool{}, unavailable: map[string]int64{}, gaps: map[string]bool{}}
	// Instrument creation fails only for invalid names; these are constant.
	ms.LeasesHeld, _ = m.Int64UpDownCounter("leasehold.leases.held", metric.WithDescription("Partition leases held by this process."), metric.WithUnit("{lease}"))
	ms.Acquisitions, _ = m.Int64Counter("leasehold.lease.acquisitions", metric.WithDescription("Partition leases acquired."), metric.WithUnit("{lease}"))
	ms.Losses, _ = m.Int64Counter("leasehold.lease.losses", metric.WithDescription("Leases lost, by reason (refused, deadline)."), metric.WithUnit("{lease}"))
	ms.RenewDuration, _ = m.Float64Histogram("leasehold.lease.renew.duration", metric.WithDescription("Round trip of a successful lease renewal."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
	ms.JobsProcessed, _ = m.Int64Counter("leasehold.jobs.processed", metric.WithDescription("Handler attempts that succeeded."), metric.WithUnit("{job}"))
	ms.JobsFailed, _ = m.Int64Counter("leasehold.jobs.failed", metric.WithDescription("Handler attempts that failed (errors, panics, effects not stored)."), metric.WithUnit("{job}"))
	ms.JobsDeadLettered, _ = m.Int64Counter("leasehold.jobs.dead_lettered", metric.WithDescription("Jobs sent to the dead-letter subject."), metric.WithUnit("{job}"))
	ms.JobsInFlight, _ = m.Int64UpDownCounter("leasehold.jobs.in_flight", metric.WithDescription("Jobs whose attempts run now (handler, backoff, dead letter), over every partition held by a worker of this process."), metric.WithUnit("{job}"))
	ms.JobsHung, _ = m.Int64Counter("leasehold.jobs.hung", metric.WithDescription("Handlers that did not return after their context ended (HandleTimeout, a lost lease); their partition was released."), metric.WithUnit("{job}"))
	ms.EffectsNoStream, _ = m.Int64Counter("leasehold.effects.no_stream", metric.WithDescription("Effects refused at once because no stream stores their subject; the worker's log names it."), metric.WithUnit("{effect}"))
	ms.HandlerDuration, _ = m.Float64Histogram("leasehold.handler.duration", metric.WithDescription("Time a handler took for one attempt."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30))
	ms.EffectsEmitted, _ = m.Int64Counter("leasehold.effects.emitted", metric.WithDescription("Stamped effects published or applied by handlers."), metric.WithUnit("{effect}"))
	ms.EffectsPreempted, _ = m.Int64Counter("leasehold.effects.preempted", metric.WithDescription("Effects answered as duplicates of a message that is not theirs: another publisher used their message ID first."), metric.WithUnit("{effect}"))
	ms.SinkRefusals, _ = m.Int64Counter("leasehold.sink.refusals", metric.WithDescription("Effects a sink refused for good, by scope (stale and split-brain; \"-\" for the rest) and outcome."), metric.WithUnit("{effect}"))
	ms.SinkEffects, _ = m.Int64Counter("leasehold.sink.effects", metric.WithDescription("Sink decisions by outcome (accepted, duplicate, rejected_stale, rejected_split_brain, rejected_unverified, rejected_bad_stamp, advanced, error)."), metric.WithUnit("{effect}"))
	return ms
}

// register creates the gauges and their callback. It runs on the first
// SetEpoch, so that sinks, which never hold leases, register nothing.
func (m *Metrics) register() {
	epoch, _ := m.meter.Int64ObservableGauge("leasehold.partition.epoch", metric.WithDescription("Epoch of each partition lease held by a worker of this process (with telemetry.Config.PartitionLabels only)."))
	lag, _ := m.meter.Int64ObservableGauge("leasehold.consumer.lag", metric.WithDescription("Jobs waiting in the partitions held by the workers of this process: their sum, or each partition's with telemetry.Config.PartitionLabels."), metric.WithUnit("{job}"))
	stalled, _ := m.meter.Int64ObservableGauge("leasehold.partition.stalled", metric.WithDescription("Partitions held by the workers of this process that have jobs waiting and have made no progress for the worker's stall time: their count, or 1 for each with telemetry.Config.PartitionLabels."))
	unavailable, _ := m.meter.Int64ObservableGauge("leasehold.effect.subjects.unavailable", metric.WithDescription("Effect subjects a worker of this process found without a stream: jobs publishing there fail at once and are dead-lettered. The worker's log and /readyz name them."), metric.WithUnit("{subject}"))
	_, _ = m.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		m.mu.Lock()
		defer m.mu.Unlock()
		if !m.labels {
			// One series each for the process.
			var lags, stalls, subjects int64
			for _, l := range m.lags {
				lags += l
			}
			for range m.stalled {
				stalls++
			}
			for _, n := range m.unavailable {
				subjects += n
			}
			o.ObserveInt64(lag, lags)
			o.ObserveInt64(stalled, stalls)
			o.ObserveInt64(unavailable, subjects)
			return nil
		}
		for h, e := range m.epochs {
			o.ObserveInt64(epoch, e, metric.WithAttributes(partitionAttrs(h.worker, h.partition)...))
		}
		for h, l := range m.lags {
			o.ObserveInt64(lag, l, metric.WithAttributes(partitionAttrs(h.worker, h.partition)...))
		}
		for h := range m.stalled {
			o.ObserveInt64(stalled, 1, metric.WithAttributes(partitionAttrs(h.worker, h.partition)...))
		}
		for w, n := range m.unavailable {
			o.ObserveInt64(unavailable, n, metric.WithAttributes(AttrWorker.String(w), semconv.MessagingClientID(w)))
		}
		return nil
	}, epoch, lag, stalled, unavailable)
}

// partitionAttrs name partition p held by worker, in leasehold's
// attributes and in OpenTelemetry's messaging conventions.
func partitionAttrs(worker string, p leasehold.Partition) []attribute.KeyValue {
	return []attribute.KeyValue{
		AttrPartition.Int64(int64(p)), AttrWorker.String(worker),
		semconv.MessagingDestinationPartitionID(p.String()), semconv.MessagingClientID(worker),
	}
}

// PartitionAttrs is the measurement option of a count about partition p
// held by worker (JobsHung): its partition and worker with
// Config.PartitionLabels, none without.
func (m *Metrics) PartitionAttrs(worker string, p leasehold.Partition) metric.MeasurementOption {
	if !m.labels {
		return metric.WithAttributeSet(*attribute.EmptySet())
	}
	return metric.WithAttributes(partitionAttrs(worker, p)...)
}

// SetEpoch records the epoch of partition p's lease held by worker; 0
// forgets the lease (and its lag).
func (m *Metrics) SetEpoch(worker string, p leasehold.Partition, e leasehold.Epoch) {
	m.once.Do(m.register)
	k := held{worker, p}
	m.mu.Lock()
	defer m.mu.Unlock()
	if e == 0 {
		delete(m.epochs, k)
		delete(m.lags, k)
		delete(m.stalled, k)
		return
	}
	m.epochs[k] = int64(e)
}

// SetLag records how many jobs wait in partition p, held by worker. It is
// ignored unless SetEpoch recorded the lease.
func (m *Metrics) SetLag(worker string, p leasehold.Partition, lag uint64) {
	k := held{worker, p}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.epochs[k]; ok {
		m.lags[k] = int64(lag)
	}
}

// SetStalled records whether partition p, held by worker, is stalled.
func (m *Metrics) SetStalled(worker string, p leasehold.Partition, stalled bool) {
	m.once.Do(m.register)
	k := held{worker, p}
	m.mu.Lock()
	defer m.mu.Unlock()
	if stalled {
		m.stalled[k] = true
	} else {
		delete(m.stalled, k)
	}
}

// SetSubjectsUnavailable records how many effect subjects worker found
// without a stream; 0 forgets the worker.
func (m *Metrics) SetSubjectsUnavailable(worker string, n int) {
	m.once.Do(m.register)
	m.mu.Lock()
	defer m.mu.Unlock()
	if n == 0 {
		delete(m.unavailable, worker)
	} else {
		m.unavailable[worker] = int64(n)
	}
}

// SetSinkGap records whether the sink runner named sink is stopped at a
// gap in its effect log: leasehold_sink_gap{leasehold_sink} is 1 while it
// is, until an operator resumes it.
func (m *Metrics) SetSinkGap(sink string, gap bool) {
	m.sinkOnce.Do(m.registerSink)
	m.mu.Lock()
	defer m.mu.Unlock()
	if gap {
		m.gaps[sink] = true
	} else {
		delete(m.gaps, sink)
	}
}

// registerSink creates the sink gauges, apart from the workers' so that a
// worker process exports none of them.
func (m *Metrics) registerSink() {
	gap, _ := m.meter.Int64ObservableGauge("leasehold.sink.gap", metric.WithDescription("1 for each sink runner of this process stopped at a gap in its effect log (messages removed before it handled them); it applies nothing until an operator resumes it."))
	_, _ = m.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		m.mu.Lock()
		defer m.mu.Unlock()
		for s := range m.gaps {
			o.ObserveInt64(gap, 1, metric.WithAttributes(AttrSink.String(s)))
		}
		return nil
	}, gap)
}

// SinkOutcome returns the measurement options of one sink's outcome, to
// pass to SinkEffects.Add. Build them once per sink and outcome: Add with
// a prepared slice does not allocate.
func SinkOutcome(sink, outcome string) []metric.AddOption {
	return []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(AttrSink.String(sink), AttrOutcome.String(outcome)))}
}
