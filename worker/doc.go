// Package worker is the SDK leasehold users write job handlers with: a
// producer that enqueues jobs on a partitioned JetStream stream, and a
// Worker that takes its share of the partitions through epoch-numbered
// leases, runs each partition's jobs in order, stamps everything the
// handlers write with the lease's epoch, and records progress so that a
// former holder can never make the partition skip work.
//
// The contract:
//
//   - Jobs live in the stream "<prefix>-jobs", partition p on the subject
//     "<prefix>.jobs.<p>" (see ProvisionJobs). A Producer picks the
//     partition from a key the way Kafka does (leasehold.PartitionFor), and
//     sends every job with a Nats-Msg-Id, so its retries store a job once.
//   - A partition's jobs run on the worker holding its lease, up to
//     Config.PartitionConcurrency of them at once, all under the lease's one
//     epoch: the jobs of one order key (the key Producer.Enqueue
//     partitioned them by, leasehold.HeaderOrderKey) one after another in
//     stream order, and jobs of other keys beside them (Config.Order; a
//     job with no order key waits for every earlier job of its partition).
//     Each held partition may always run one job; further jobs at once take
//     slots of the worker's pool of Config.MaxConcurrency. Before the first
//     job, every Config.Fences sink is advanced to the new epoch and a
//     barrier is published to every barrier subject, so the previous
//     holder's later writes are refused.
//   - Effects (Job.Publish, Job.Emit, Job.Apply, Job.NextStamp) carry the
//     headers Leasehold-Partition, Leasehold-Epoch and Leasehold-Key, an
//     idempotency key derived from the job's origin (the prefix, partition
//     and sequence where it was first stored: its place, unless a replay or
//     a move stored it again; see Job.Origin) and the effect index, plus W3C
//     trace context; published effects use the key and the epoch as
//     Nats-Msg-Id (MessageID). A job re-run after a fail-over, or replayed
//     from its dead letter, emits the same keys; the sinks, not the stream,
//     dedupe them.
//   - Progress is not the consumer's acks: it is a compare-and-set on the
//     lease bucket (coordinator.Lease.Commit) of a watermark and the jobs
//     done beyond it, and it counts a job only once all of the job's
//     effects (or its dead letter) are acknowledged, and those of every job
//     the runner completed before it. A worker that lost its lease cannot
//     commit, so its successor resumes after the watermark, skipping the
//     jobs done beyond it, and runs the rest again.
//     Processing is at least once; effects are exactly once where the
//     destination dedupes by key.
//   - A failed attempt is retried with backoff up to Config.MaxAttempts
//     (or its kind's: Handle's MaxAttempts, Backoff and Timeout options),
//     then the job is dead-lettered to "<prefix>.dlq.<p>" with its data,
//     headers and the error. Permanent errors and payloads that do not
//     decode are dead-lettered at once; a panic counts as a failure. A
//     handler that returns Snooze(d) runs again after d, in its place,
//     without using an attempt, up to Config.MaxSnoozes times.
//   - Kinds: a Mux routes each job by its Leasehold-Kind header to a typed
//     handler (Handle, HandleWith); Enqueue encodes a typed payload. A job
//     of a kind no handler serves is dead-lettered at once. Kinds do not
//     change the lease or the fence.
//   - Delayed jobs (EnqueueAt, EnqueueIn) and periodic jobs (Periodic,
//     Producer.Schedule) are message schedules the NATS server runs
//     (nats-server 2.12+); Producer.Status and Producer.Wait tell where a
//     job is: scheduled, pending, running, done, dead-lettered, replayed,
//     purged or removed unrun (see Record).
//   - A handler's context ends when its lease is lost or its local deadline
//     passes, and emitting then fails with leasehold.ErrLeaseLost. That is
//     a courtesy: a paused process cannot see its own pause, which is why
//     sinks fence by epoch.
//   - Run returns after a graceful shutdown: fetching stops, running
//     handlers finish while the lease holds, effects are awaited, progress
//     is committed and leases are released, so successors start at once.
//   - Telemetry (Config.Telemetry, ProducerConfig.Telemetry; the
//     OpenTelemetry globals by default): an enqueue is a "send" span whose
//     context the job carries; each attempt is a "process" span under it,
//     and each effect a "send" span under the attempt, whose context the
//     effect carries to the sinks. Lease events, job and effect counts,
//     handler durations, epochs and consumer lag are recorded as the
//     telemetry package describes.
package worker
