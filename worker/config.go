package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
)

// Fence is a sink that can be told about a take-over: on acquiring a
// partition, a worker advances every fence to its lease before handling the
// first job, so that the previous holder's later writes are refused from
// that moment on. A fence that refuses the lease as stale stops the
// partition. Every sink in package sink is a Fence.
type Fence interface {
	Advance(ctx context.Context, l leasehold.Lease) error
}

// Config configures a Worker.
type Config struct {
	// JetStream is the connection jobs are read and effects published
	// through. The worker does not own (or close) it. Required.
	JetStream jetstream.JetStream
	// Prefix names the job stream (see ProvisionJobs). Required.
	Prefix string
	// Partitions is the job stream's partition count; Run refuses a stream
	// provisioned with another. Required.
	Partitions int
	// Handler handles the jobs. Required.
	Handler Handler
	// Middleware wraps Handler, the first one outermost.
	Middleware []Middleware

	// Bucket is the lease bucket (coordinator.OpenBucket or Provision).
	// Required unless ProvisionBucket is set.
	Bucket *coordinator.Bucket
	// ProvisionBucket, when Bucket is nil, makes Run create (or check) the
	// lease bucket it describes through JetStream; its name defaults to
	// "<prefix>-leases". A lease bucket serves one job stream: Run refuses
	// a bucket another job stream uses.
	ProvisionBucket *coordinator.BucketConfig
	// Coordinator holds the lease settings: the worker ID (Worker), TTL,
	// renewal, rebalancing and shutdown timeouts. Partitions, OnAcquire and
	// OnRevoke are the worker's own and must be left unset. Coordinator's
	// defaults apply; the worker ID defaults to the host name and a random
	// suffix.
	Coordinator coordinator.Config

	// PartitionConcurrency is how many jobs of one partition may run at
	// once, under the partition's one lease and epoch, in the order Order
	// keeps. With 1 a partition runs one job at a time, in stream order,
	// as leasehold did before. Default 16: at 4 partitions, 64 handlers
	// in flight run 50 ms I/O-bound jobs at about 1,200 a second in one
	// process. At most MaxPartitionConcurrency. A partition tracks at most
	// max(MaxInFlight, 4 × PartitionConcurrency) jobs (1024 at the most)
	// from its first job not done to the furthest it read: beyond that it
	// reads no more until its first jobs are done, so a job that does not
	// finish stops the partition's intake after that many, and the stall
	// report (StallAfter) shows it.
	PartitionConcurrency int
	// Order is the order a partition keeps among the jobs it runs at once:
	// OrderKey (the default) runs the jobs of one order key one after
	// another, OrderPartition one job of the partition at a time, OrderNone
	// any job beside any other. See Order.
	Order Order
	// MaxConcurrency bounds the jobs this worker runs at once beyond one
	// per held partition: each partition always may run one job (that
	// slot is its own, so no partition waits behind the others), and every
	// further job running at once in a partition takes a slot of this
	// pool. A worker holding h partitions runs at most h + min(h ×
	// (PartitionConcurrency − 1), MaxConcurrency) handlers. Default 100,
	// as River's MaxWorkers; Asynq defaults to the CPU count, which suits
	// jobs that compute, while jobs that wait on I/O want tens in flight.
	// A job waiting out its backoff keeps its slot.
	MaxConcurrency int
	// MaxAttempts is how many failed attempts a job gets before it is
	// dead-lettered. Default 5.
	MaxAttempts int
	// Backoff is the wait after failed attempt n (1, 2, ...) before the
	// next. The partition waits with it: order is kept. Default:
	// exponential from 100ms, doubling up to 30s, with jitter.
	Backoff func(attempt int) time.Duration
	// MaxSnoozes is how many times a job's handler may snooze it (Snooze)
	// before a snooze counts as a failed attempt. Default 100; negative:
	// none may.
	MaxSnoozes int
	// HandleTimeout bounds one attempt, as Kafka's max.poll.interval.ms
	// bounds the time between polls: past it the handler's context is
	// cancelled (its cause matches ErrHandleTimeout) and the attempt counts
	// as failed, towards MaxAttempts and then the dead-letter stream.
	// Renewal does not depend on the handler, so without this bound a
	// handler that never returns would hold its partition for good. Raise
	// it for jobs that take longer. Default 5 minutes.
	HandleTimeout time.Duration
	// TransientFor is how long a job's effects may keep failing for the
	// transport's reasons (timeouts, a lost connection, no responders)
	// without using up attempts. Past it the worker asks JetStream which
	// stream stores the effect's subject. When none does, the failure
	// counts, and the subject's breaker opens: every later publish there
	// fails at once with an error matching ErrNoStream, so that the jobs
	// on it are dead-lettered after MaxAttempts without each waiting
	// TransientFor (the leasehold_effect_subjects_unavailable gauge and
	// Ready report it until a stream stores the subject). When a stream
	// stores it but did not answer, or NATS does not answer, it is an
	// outage and the failure still uses no attempt; the stall report
	// (StallAfter) shows the waiting partition. Timeouts from a stream
	// that answers count. Default 1 minute, enough to ride out a server
	// restart.
	TransientFor time.Duration
	// StallAfter is how long a held partition may have jobs waiting without
	// its committed progress moving before it counts as stalled: a WARN
	// line, the leasehold_partition_stalled gauge and Worker.Ready (the
	// command's /readyz) report it. Default 2 minutes; keep it above the
	// longest job.
	StallAfter time.Duration
	// HangGrace is how long a handler may take to return once its context
	// is cancelled (HandleTimeout passed, the lease was lost, or a drain
	// ran out of time). A handler still running after it has hung: the
	// worker logs it, counts it in leasehold_jobs_hung_total, reports
	// EventJobHung and releases the partition, so that another worker can
	// take it (see ErrHandlerHung). Default 30s.
	HangGrace time.Duration

	// CommitEvery is how often a partition's progress is committed while
	// jobs flow; it is always committed on hand-off. A crash re-runs at most
	// this much work (with the same idempotency keys). Default 250ms.
	CommitEvery time.Duration
	// MaxInFlight bounds the jobs of a partition that run or whose
	// effects are published but not yet acknowledged: while that many
	// are, no job of the partition starts. Handlers never wait for an acknowledgement; a
	// job counts as done when all of its effects are acknowledged. With 1
	// (and PartitionConcurrency 1), a job's effects are acknowledged before
	// the next job starts, which keeps the effect log in job order even
	// when a publish is refused or lost and the partition runs again from
	// its job. With more, such an effect lands after the effects of later
	// jobs that were already stored (their re-runs are deduplicated), and
	// sinks apply in log order: a destination that keeps the last write
	// per key needs 1. Default 128; above 1024 it bounds nothing more than
	// 1024 does (see PartitionConcurrency).
	MaxInFlight int
	// EffectTimeout is how long an effect publish may wait for its
	// acknowledgement before it counts as failed and its job is run again.
	// Default 10s.
	EffectTimeout time.Duration
	// FetchBatch is how many jobs one pull request asks for. Default 100.
	FetchBatch int
	// FetchWait is how long one pull request waits for jobs. Default 5s.
	FetchWait time.Duration
	// TrimCommitted purges a partition's jobs up to its committed progress
	// after each commit, which keeps the job stream small. Committed
	// progress never goes back, so no worker needs them again; keep them
	// (the default) to be able to replay.
	TrimCommitted bool

	// Fences are advanced to a partition's epoch when this worker acquires
	// it, before its first job.
	Fences []Fence
	// BarrierSubjects returns the subjects a barrier is published to when
	// this worker acquires partition p, before its first job: sinks that
	// consume those subjects in order refuse the previous holder's later
	// effects from there on. Default: the default output,
	// OutputSubject(Prefix, p). Return nil to publish none.
	BarrierSubjects func(p leasehold.Partition) []string
	// StampFormat is the form in which effects, barriers and abort markers
	// carry their stamp and job mark: leasehold.StampCompact (the default)
	// writes one Leasehold-Stamp and one Leasehold-Mark header;
	// leasehold.StampLegacy writes the per-field headers releases before
	// it wrote. Sinks read both. During an upgrade, run workers with
	// StampLegacy until every sink reading their effects runs a release
	// that reads the compact form, then switch (sinks first, then
	// workers).
	StampFormat leasehold.StampFormat
	// PackEffects sends the effects an attempt emits on one subject as
	// one message: the worker holds them all until the handler returns,
	// and sends them packed (leasehold.HeaderPack), under the stamp of the
	// last and marked as the attempt's final there, so that a stream sink
	// fetches, decides and acknowledges one message for the job where it
	// did one per effect. Jobs of many effects run at up to the pace of
	// jobs of one; a job of one effect on a subject sends it as it does
	// without packing. Effects that would not fit in one message (the
	// server's max payload) leave in several. Only with StampCompact, and
	// each effect's header names must be header field names (RFC 9110
	// tokens); the server's Nats- headers a caller adds (EmitHeader) are
	// dropped from a packed effect.
	//
	// Off by default: a sink runner of a release before it takes a packed
	// message for one effect. Upgrade every sink runner that reads the
	// effects first, then turn it on in the workers. Workers with it on
	// and off may run side by side.
	PackEffects bool

	// Propagator injects trace context into effects and extracts it from
	// jobs. Default otel.GetTextMapPropagator(). Telemetry.Propagator, when
	// set, wins.
	Propagator propagation.TextMapPropagator
	// Telemetry selects the OpenTelemetry providers of the worker's spans
	// and metrics, and of its lease events (the worker adds
	// telemetry.LeaseObserver to its coordinator). Zero fields mean the
	// globals. See the package documentation of telemetry for the spans
	// and metric names.
	Telemetry telemetry.Config
	// Logger receives the worker's logs. Default slog.Default().
	Logger *slog.Logger
	// Observer receives worker events. Default: none.
	Observer Observer
}

func (c *Config) setDefaults() {
	if c.Coordinator.Worker == "" {
		c.Coordinator.Worker = defaultWorkerID()
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.MaxSnoozes == 0 {
		c.MaxSnoozes = 100
	} else if c.MaxSnoozes < 0 {
		c.MaxSnoozes = 0
	}
	if c.HandleTimeout == 0 {
		c.HandleTimeout = 5 * time.Minute
	}
	if c.HangGrace == 0 {
		c.HangGrace = 30 * time.Second
	}
	if c.CommitEvery == 0 {
		c.CommitEvery = 250 * time.Millisecond
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 128
	}
	if c.PartitionConcurrency == 0 {
		c.PartitionConcurrency = 16
	}
	if c.MaxConcurrency == 0 {
		c.MaxConcurrency = 100
	}
	if c.EffectTimeout == 0 {
		c.EffectTimeout = 10 * time.Second
	}
	if c.TransientFor == 0 {
		c.TransientFor = time.Minute
	}
	if c.StallAfter == 0 {
		c.StallAfter = 2 * time.Minute
	}
	if c.FetchBatch == 0 {
		c.FetchBatch = 100
	}
	if c.FetchWait == 0 {
		c.FetchWait = 5 * time.Second
	}
	if c.BarrierSubjects == nil {
		prefix := c.Prefix
		c.BarrierSubjects = func(p leasehold.Partition) []string { return []string{OutputSubject(prefix, p)} }
	}
	if c.Propagator == nil {
		c.Propagator = otel.GetTextMapPropagator()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Coordinator.Logger == nil {
		c.Coordinator.Logger = c.Logger
	}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	user := c.Coordinator
	c.setDefaults()
	var errs []error
	if c.JetStream == nil {
		errs = append(errs, errors.New("JetStream is nil: pass jetstream.New(nc) for the connection jobs are read through"))
	}
	if err := validPrefix(c.Prefix); err != nil {
		errs = append(errs, err)
	}
	if c.Partitions < 1 || c.Partitions > leasehold.MaxPartitions {
		errs = append(errs, fmt.Errorf("partitions %d: use the job stream's partition count (1 to %d)", c.Partitions, leasehold.MaxPartitions))
	}
	if c.Handler == nil {
		errs = append(errs, errors.New("Handler is nil: give the worker something to run, for example worker.HandlerFunc(func(ctx, job) error {...})"))
	}
	for i, mw := range c.Middleware {
		if mw == nil {
			errs = append(errs, fmt.Errorf("Middleware[%d] is nil", i))
		}
	}
	if c.Bucket == nil && c.ProvisionBucket == nil {
		errs = append(errs, errors.New("no lease bucket: set Bucket (coordinator.OpenBucket) or ProvisionBucket"))
	}
	if c.Bucket != nil && c.ProvisionBucket != nil {
		errs = append(errs, errors.New("both Bucket and ProvisionBucket are set: set one"))
	}
	if c.ProvisionBucket != nil {
		if err := c.ProvisionBucket.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("ProvisionBucket: %w", err))
		}
	}
	if user.Partitions != 0 || user.OnAcquire != nil || user.OnRevoke != nil {
		errs = append(errs, errors.New("Coordinator.Partitions, OnAcquire and OnRevoke are set by the worker: leave them unset (use Partitions and Observer)"))
	}
	cc := c.Coordinator
	cc.Partitions = c.Partitions
	if err := cc.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Coordinator: %w", err))
	}
	if c.MaxConcurrency < 0 {
		errs = append(errs, fmt.Errorf("max concurrency %d must not be negative: it bounds the jobs run at once beyond one per held partition (0: the default, 100)", c.MaxConcurrency))
	}
	if c.PartitionConcurrency < 0 || c.PartitionConcurrency > MaxPartitionConcurrency {
		errs = append(errs, fmt.Errorf("partition concurrency %d: use 1 (one job of a partition at a time) to %d (0: the default, 16)", c.PartitionConcurrency, MaxPartitionConcurrency))
	}
	if c.Order < OrderKey || c.Order > OrderNone {
		errs = append(errs, fmt.Errorf("order %d: use OrderKey, OrderPartition or OrderNone", int(c.Order)))
	}
	if c.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("max attempts %d: use at least 1", c.MaxAttempts))
	}
	if c.HandleTimeout < 0 || c.HangGrace < 0 || c.CommitEvery < 0 || c.EffectTimeout < 0 || c.FetchWait < 0 || c.TransientFor < 0 || c.StallAfter < 0 {
		errs = append(errs, errors.New("timeouts and intervals must not be negative"))
	}
	if c.FetchWait > 0 && c.FetchWait < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("fetch wait %v: use at least 100ms", c.FetchWait))
	}
	if c.MaxInFlight < 1 {
		errs = append(errs, fmt.Errorf("max in flight %d: use at least 1", c.MaxInFlight))
	}
	if c.FetchBatch < 1 || c.FetchBatch > 10000 {
		errs = append(errs, fmt.Errorf("fetch batch %d: use 1 to 10000", c.FetchBatch))
	}
	if err := c.StampFormat.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.PackEffects && c.StampFormat == leasehold.StampLegacy {
		errs = append(errs, errors.New("PackEffects with StampLegacy: packed effects carry the compact stamp, as every sink that reads them does; use StampCompact (upgrade sinks first, then switch workers to the compact stamp, then to packing)"))
	}
	for i, f := range c.Fences {
		if f == nil {
			errs = append(errs, fmt.Errorf("Fences[%d] is nil", i))
		}
	}
	return errors.Join(errs...)
}

// DefaultBackoff waits 100ms after the first failed attempt, doubling up to
// 30s, with up to 20% jitter either way so that failing partitions do not
// retry in step.
func DefaultBackoff(attempt int) time.Duration {
	d := min(100*time.Millisecond<<min(max(attempt-1, 0), 10), 30*time.Second)
	return d - d/5 + rand.N(2*d/5+1)
}

func defaultWorkerID() string {
	host, _ := os.Hostname()
	b := []byte(host)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '-'
		}
	}
	if len(b) == 0 {
		b = []byte("worker")
	}
	if len(b) > 100 {
		b = b[:100]
	}
	id := nuid.Next()
	return string(b) + "-" + id[len(id)-6:]
}
