// Package telemetry is leasehold's OpenTelemetry: the trace context that
// travels in NATS headers, the names of its spans, attributes and metrics,
// the lease observer, and the setup a process calls to export traces and
// serve metrics, liveness and readiness.
//
// The contract:
//
//   - Every component (worker.Config, worker.ProducerConfig and each sink's
//     Config) takes a Config with the tracer provider, meter provider and
//     propagator to use; zero fields mean the OpenTelemetry globals, which
//     are no-ops until something installs providers (Setup does).
//   - W3C trace context travels in message headers through HeaderCarrier,
//     which reads names without regard to case (the stock
//     propagation.HeaderCarrier misses a lowercase traceparent).
//   - Spans follow the messaging conventions: "send <subject template>"
//     (producer) for an enqueue, an effect (a worker's only when its
//     attempt's trace is sampled), a barrier and a dead letter;
//     "process <subject template>" (consumer) for a worker's attempt at a
//     job, the child of the enqueue, and for a log sink's decision on an
//     effect, the child of the effect's send; an internal "apply" span for
//     a direct sink's write, the child of the handler's span. A subject
//     template is the subject with its partition token replaced by
//     {partition} (SubjectTemplate). Lease events are root spans (lease
//     acquire, lease renew, lease lost, lease release).
//   - A write refused for a stale epoch is a span with status Error,
//     error.type=stale_epoch, the attributes leasehold.partition,
//     leasehold.epoch (the write's), leasehold.max_epoch, leasehold.worker
//     (the writer) and, when the sink knows it, leasehold.holder, and the
//     event leasehold.fence.rejected. It sits in the trace of the job the
//     zombie was handling, so a search by that tag finds the whole story;
//     when that trace was not sampled, the refusal starts a trace of its
//     own, linked to it, which KeepRefusals samples.
//   - Metrics go through the OpenTelemetry metric API; the Prometheus
//     exporter names them leasehold_*, in base units, with _total on
//     counters (see Metrics).
package telemetry
