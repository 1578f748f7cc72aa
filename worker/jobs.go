package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/internal/statusevents"
)

// Stream metadata keys that leasehold writes and checks.
const (
	metaKind       = "leasehold.kind"
	metaPrefix     = "leasehold.prefix"
	metaPartitions = "leasehold.partitions"
)

// JobsStream names the job stream of prefix: "<prefix>-jobs".
func JobsStream(prefix string) string { return prefix + "-jobs" }

// DLQStream names the dead-letter stream of prefix: "<prefix>-dlq".
func DLQStream(prefix string) string { return prefix + "-dlq" }

// EffectsStream names the default output stream of prefix:
// "<prefix>-effects".
func EffectsStream(prefix string) string { return prefix + "-effects" }

// JobSubject is the subject of partition p's jobs: "<prefix>.jobs.<p>".
func JobSubject(prefix string, p leasehold.Partition) string {
	return prefix + ".jobs." + p.String()
}

// DLQSubject is the subject partition p's dead letters go to:
// "<prefix>.dlq.<p>".
func DLQSubject(prefix string, p leasehold.Partition) string {
	return prefix + ".dlq." + p.String()
}

// OutputSubject is partition p's default output, where Job.Emit publishes
// and barriers go: "<prefix>.out.<p>".
func OutputSubject(prefix string, p leasehold.Partition) string {
	return prefix + ".out." + p.String()
}

// JobsConfig describes the streams ProvisionJobs creates for one job
// stream: the jobs, their dead letters, and the default output.
type JobsConfig struct {
	// Prefix names the streams and starts their subjects. It must be one
	// subject token: letters, digits, '-' and '_'. Required.
	Prefix string
	// Partitions is the number of job partitions, 1 to 65536. It is
	// recorded in the stream's metadata and cannot change later: keys
	// would map to other partitions. Required.
	Partitions int
	// Replicas of every stream: 1 for development, 3 in production.
	// Default 1.
	Replicas int
	// MaxAge is how long a job is kept. Default 0: jobs stay until MaxBytes
	// is reached or workers trim them (Config.TrimCommitted). A job that
	// ages out before a worker handles it is gone (its status says removed
	// unrun), so set it well above the longest backlog you can have. The
	// schedules of delayed and periodic jobs are exempt (they carry
	// "Nats-TTL: never", so a job stream with MaxAge and schedules allows
	// per-message TTLs); the jobs they fire age out as any job does.
	MaxAge time.Duration
	// MaxBytes bounds the job stream's size; when full, enqueues are
	// refused rather than old jobs dropped. Default 0: no bound.
	MaxBytes int64
	// Duplicates is the window in which a repeated Nats-Msg-Id is dropped,
	// on every stream: producer retries of a job, and effects re-emitted by
	// a job re-run after a fail-over. Keep it above the longest fail-over
	// plus re-run time. Default 2 minutes.
	Duplicates time.Duration
	// DLQMaxAge is how long dead letters are kept. Default 0: forever.
	// The records beside them (see Record) age out with them, and a job
	// whose dead letter was replayed or purged, or that aged out unrun,
	// longer ago than that is reported done again.
	DLQMaxAge time.Duration
	// EffectsMaxAge is how long effects in the default output are kept.
	// Default 0: forever (bound it once sinks have applied them).
	EffectsMaxAge time.Duration
	// NoEffects skips the default output stream, for workers that only
	// write to sinks or to subjects of their own streams.
	NoEffects bool
	// Schedules turns message schedules (delayed and periodic jobs) on
	// for the job stream, new or existing; the server cannot turn them off
	// again. They are off unless asked for, because a stream that
	// schedules must allow roll-ups, which a schedule uses to replace the
	// one before it on its own subject: any publisher allowed on a job
	// subject could then send a roll-up header that purges the jobs of
	// that partition before it (or with "Nats-Rollup: all" every
	// partition's jobs and schedules; the worker that meets such a message
	// dead-letters it, saying what was purged, whatever its handler), and
	// it must discard old messages when full. Turn them on where only trusted publishers may write job
	// subjects. ProvisionJobs fails, saying why, where they cannot be on:
	// a server before nats-server 2.12, or a stream with MaxBytes.
	Schedules bool
}

func (c *JobsConfig) setDefaults() {
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.Duplicates == 0 {
		c.Duplicates = 2 * time.Minute
	}
}

// Validate reports every problem with c at once.
func (c JobsConfig) Validate() error {
	c.setDefaults()
	var errs []error
	if err := validPrefix(c.Prefix); err != nil {
		errs = append(errs, err)
	}
	if c.Partitions < 1 || c.Partitions > leasehold.MaxPartitions {
		errs = append(errs, fmt.Errorf("partitions %d: use 1 to %d", c.Partitions, leasehold.MaxPartitions))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("replicas %d: use 1 for development or 3 (or 5) in production", c.Replicas))
	}
	if c.MaxAge < 0 || c.DLQMaxAge < 0 || c.EffectsMaxAge < 0 || c.MaxBytes < 0 {
		errs = append(errs, errors.New("max ages and max bytes must not be negative (0 means no limit)"))
	}
	if c.Duplicates < time.Second {
		errs = append(errs, fmt.Errorf("duplicate window %v: use at least a second, and more than the longest fail-over", c.Duplicates))
	}
	for _, age := range []time.Duration{c.MaxAge, c.DLQMaxAge, c.EffectsMaxAge} {
		if age > 0 && age < c.Duplicates {
			errs = append(errs, fmt.Errorf("max age %v is below the duplicate window %v: the server requires the window to fit in the age", age, c.Duplicates))
			break
		}
	}
	return errors.Join(errs...)
}

// validPrefix accepts one subject token that is also a valid stream and
// consumer name part.
func validPrefix(p string) error {
	if p == "" {
		return errors.New("prefix is empty: name the job stream, for example \"orders\"")
	}
	if len(p) > 64 {
		return fmt.Errorf("prefix %q is longer than 64 bytes", p)
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("prefix %q: use letters, digits, '-' and '_' only (it is one subject token and part of stream names)", p)
		}
	}
	return nil
}

// ErrStreamConfig is matched by errors about a job, dead-letter or output
// stream that exists with settings leasehold cannot work with.
var ErrStreamConfig = errors.New("worker: stream does not match the job stream configuration")

// ProvisionJobs creates the job stream "<prefix>-jobs" on subjects
// "<prefix>.jobs.<p>", the dead-letter stream "<prefix>-dlq" and, unless
// NoEffects is set, the output stream "<prefix>-effects" on
// "<prefix>.out.>", and the status page's events stream "<prefix>-events"
// (so that a program's take-overs, lease losses and refused writes reach
// its page), and on nats-server 2.11 or later the KV bucket of unique jobs
// "<prefix>-unique" (UniqueBucket). Streams that exist already are checked, and a stream
// that cannot work as configured (another partition count, other
// subjects, memory storage, work-queue retention) is refused with an error
// matching ErrStreamConfig that says what differs. Streams are limit-based
// logs: progress is tracked by leasehold, not by JetStream acks.
func ProvisionJobs(ctx context.Context, js jetstream.JetStream, cfg JobsConfig) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("worker: invalid jobs config: %w", err)
	}
	explicitWindow := cfg.Duplicates != 0
	cfg.setDefaults()
	streams := []jetstream.StreamConfig{
		{
			Name:        JobsStream(cfg.Prefix),
			Description: "leasehold jobs, partitioned by subject",
			Subjects:    []string{cfg.Prefix + ".jobs.*"},
			MaxAge:      cfg.MaxAge,
			MaxBytes:    orUnlimited(cfg.MaxBytes),
			Metadata:    meta("jobs", cfg),
		},
		{
			Name:        DLQStream(cfg.Prefix),
			Description: "leasehold dead letters: jobs that failed every attempt",
			Subjects:    []string{cfg.Prefix + ".dlq.>"},
			MaxAge:      cfg.DLQMaxAge,
			MaxBytes:    -1,
			Metadata:    meta("dlq", cfg),
		},
	}
	if !cfg.NoEffects {
		streams = append(streams, jetstream.StreamConfig{
			Name:        EffectsStream(cfg.Prefix),
			Description: "leasehold effects: the default output, stamped with partition and epoch",
			Subjects:    []string{cfg.Prefix + ".out.>"},
			MaxAge:      cfg.EffectsMaxAge,
			MaxBytes:    -1,
			Metadata:    meta("effects", cfg),
		})
	}
	schedules := cfg.Schedules
	if schedules && !serverAtLeast(js.Conn(), 2, 12) {
		return fmt.Errorf("%w: nats-server %s does not schedule messages: delayed and periodic jobs need nats-server 2.12 or later (leave JobsConfig.Schedules off)", ErrNoSchedules, js.Conn().ConnectedServerVersion())
	}
	for i, sc := range streams {
		sc.Retention = jetstream.LimitsPolicy
		sc.Storage = jetstream.FileStorage
		sc.Discard = jetstream.DiscardNew
		sc.Replicas = cfg.Replicas
		sc.Duplicates = cfg.Duplicates
		sc.MaxMsgs = -1
		sc.MaxMsgsPerSubject = -1
		sc.MaxMsgSize = -1
		// Unlimited (-1) would fall back to the server's default cap of
		// 1000 consumers a stream, and every held partition reads through
		// a consumer of its own: say how many the job stream needs.
		sc.MaxConsumers = maxConsumers(cfg.Partitions)
		if i == 0 && schedules && !scheduleConfig(&sc) {
			return fmt.Errorf("%w: job stream %s has a size limit (MaxBytes %d), and a stream that schedules must discard old messages when full, which would drop jobs (leave JobsConfig.Schedules off, or MaxBytes 0)", ErrNoSchedules, sc.Name, sc.MaxBytes)
		}
		if err := ensureStream(ctx, js, sc, cfg.Partitions); err != nil {
			return err
		}
		if i == 0 && schedules {
			if err := enableSchedules(ctx, js, sc.Name); err != nil {
				return err
			}
		}
		if explicitWindow {
			if err := setWindow(ctx, js, sc.Name, cfg.Duplicates); err != nil {
				return err
			}
		}
	}
	if serverAtLeast(js.Conn(), 2, 11) {
		if err := provisionUnique(ctx, js, cfg.Prefix, cfg.Replicas); err != nil {
			return err
		}
	}
	if err := provisionCancels(ctx, js, cfg.Prefix, cfg.Replicas); err != nil {
		return err
	}
	if _, err := statusevents.Provision(ctx, js, cfg.Prefix, cfg.Replicas); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	return nil
}

// setWindow sets an existing stream's duplicate window to the one asked
// for. Only an explicit JobsConfig.Duplicates does: the default does not
// undo a window an operator changed by hand.
func setWindow(ctx context.Context, js jetstream.JetStream, name string, window time.Duration) error {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("worker: look up stream %s: %w", name, err)
	}
	sc := s.CachedInfo().Config
	if sc.Duplicates == window {
		return nil
	}
	if sc.MaxAge > 0 && window > sc.MaxAge {
		return fmt.Errorf("%w: stream %s: a duplicate window of %v does not fit in its max age %v", ErrStreamConfig, name, window, sc.MaxAge)
	}
	sc.Duplicates = window
	if _, err := js.UpdateStream(ctx, sc); err != nil {
		return fmt.Errorf("worker: set the duplicate window of stream %s to %v: %w", name, window, err)
	}
	return nil
}

// maxConsumers allows a consumer per partition for the holder and one for
// a successor during a hand-off, plus room for operators' own.
func maxConsumers(partitions int) int { return max(1000, 2*partitions+100) }

func meta(kind string, cfg JobsConfig) map[string]string {
	return map[string]string{
		metaKind:       kind,
		metaPrefix:     cfg.Prefix,
		metaPartitions: strconv.Itoa(cfg.Partitions),
	}
}

func orUnlimited(n int64) int64 {
	if n == 0 {
		return -1
	}
	return n
}

func ensureStream(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig, partitions int) error {
	for range 2 {
		s, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) { return js.Stream(ctx, want.Name) })
		if err == nil {
			return checkStream(s.CachedInfo().Config, want, partitions)
		}
		if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("worker: look up stream %s: %w", want.Name, err)
		}
		// Right after a delete of the same stream the server may refuse
		// the create for a moment (10049).
		err = retry.Do(ctx, func(ctx context.Context) error { _, err := js.CreateStream(ctx, want); return err })
		if err == nil {
			return nil
		}
		if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("worker: create stream %s: %w", want.Name, err)
		}
		// Created concurrently by another process: check theirs.
	}
	return fmt.Errorf("worker: stream %s: created and deleted concurrently; try again", want.Name)
}

// checkStream refuses an existing stream leasehold cannot work with, saying
// what differs. Limits an operator may tune (ages, sizes) are left alone.
func checkStream(have, want jetstream.StreamConfig, partitions int) error {
	var probs []string
	if !slices.Equal(have.Subjects, want.Subjects) {
		probs = append(probs, fmt.Sprintf("its subjects are %v, not %v", have.Subjects, want.Subjects))
	}
	if have.Metadata[metaKind] != want.Metadata[metaKind] {
		probs = append(probs, fmt.Sprintf("it was not created by leasehold as a %s stream (metadata %s=%q)", want.Metadata[metaKind], metaKind, have.Metadata[metaKind]))
	}
	if got := have.Metadata[metaPartitions]; got != strconv.Itoa(partitions) {
		probs = append(probs, fmt.Sprintf("it was provisioned for %s partitions and %d were asked for; the partition count cannot change, since keys would move to other partitions", orNone(got), partitions))
	}
	if have.Retention != jetstream.LimitsPolicy {
		probs = append(probs, fmt.Sprintf("its retention is %v; leasehold needs a limits-based log, since progress is tracked by leasehold, not by acks", have.Retention))
	}
	if have.Storage != jetstream.FileStorage {
		probs = append(probs, "its storage is memory, so a server restart would lose every job")
	}
	if have.Duplicates <= 0 {
		probs = append(probs, "it has no duplicate window, so retried publishes would be stored twice")
	}
	if have.Replicas < want.Replicas {
		probs = append(probs, fmt.Sprintf("it has %d replicas and %d were asked for", have.Replicas, want.Replicas))
	}
	if have.Sealed {
		probs = append(probs, "it is sealed")
	}
	if len(probs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: stream %s: %s; provision the job stream under another prefix, or move the data aside and delete the stream",
		ErrStreamConfig, want.Name, strings.Join(probs, "; "))
}

func orNone(s string) string {
	if s == "" {
		return "an unknown number of"
	}
	return s
}

// streamPartitions reads the partition count recorded on the job stream of
// prefix, and refuses a stream that does not have partitions partitions.
func streamPartitions(ctx context.Context, js jetstream.JetStream, prefix string, partitions int) error {
	s, err := js.Stream(ctx, JobsStream(prefix))
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("worker: job stream %s does not exist: create it with worker.ProvisionJobs (or `leasehold init`)", JobsStream(prefix))
	}
	if err != nil {
		return fmt.Errorf("worker: look up job stream %s: %w", JobsStream(prefix), err)
	}
	got := s.CachedInfo().Config.Metadata[metaPartitions]
	if got != strconv.Itoa(partitions) {
		return fmt.Errorf("%w: job stream %s has %s partitions and this is configured with %d: use the stream's partition count, since a different count sends keys to other partitions",
			ErrStreamConfig, JobsStream(prefix), orNone(got), partitions)
	}
	return nil
}
