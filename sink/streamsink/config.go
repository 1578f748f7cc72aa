package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// Config configures a Runner. Every name derives from Prefix by default.
type Config struct {
	// Prefix names the deployment. Default "leasehold".
	Prefix string
	// Stream is the effect log the runner consumes. Default
	// "<prefix>-effects".
	Stream string
	// Provision has New create the effect log, on Subjects, when it is
	// missing: file storage, no limits, DenyDelete and DenyPurge (so that
	// it is trimmed by nothing and can have no holes). Off by default:
	// the log belongs to the job streams (`leasehold init`,
	// worker.ProvisionJobs), and init refuses a log it did not create.
	// Without it New fails on a missing log with an error matching
	// ErrNoLog that says to run init. Set it for a log no job stream
	// provisions.
	Provision bool
	// Subjects of the effect log when New creates it. Default
	// ["<prefix>.out.>"].
	Subjects []string
	// AllowTrimming accepts an effect log whose settings can remove
	// messages the runner has not handled: MaxAge, MaxMsgs or MaxBytes
	// with DiscardOld, MaxMsgsPerSubject, per-message TTLs, a work-queue
	// or interest retention. A runner that falls behind them meets a gap
	// and stops there (see ErrGap); Runner.Retention states how far
	// behind it may fall. Without it New refuses such a log, since a gap
	// can hide a take-over's barrier and there is no safe way past one
	// but an operator's (Runner.ResumeAfterGap).
	AllowTrimming bool
	// FilterSubject limits the runner to part of the log. Default: all of
	// it.
	FilterSubject string
	// Consumer is the durable consumer's name. Default "<prefix>-sink".
	Consumer string
	// StateBucket is the KV bucket holding the runner's progress: the
	// last log position handled (key "<consumer>") and the fences (keys
	// "<consumer>.fences.<shard>"). Default "<prefix>-sink-state".
	StateBucket string
	// MaxFences bounds the fences (scope and partition pairs) the runner
	// keeps. An effect or barrier that would create one more is refused
	// for good (see ErrFenceLimit) and the runner goes on. Default
	// 131072 (DefaultMaxFences: two job streams of 65536 partitions, or
	// one and 65536 locks); at most 262144 (MaxFencesLimit).
	MaxFences int
	// MaxHeldEffects and MaxHeldBytes bound the effects of jobs the runner
	// holds until the rest of their job is in the log (see groups.go), and
	// their size: data and headers, as written on the wire. At the limit it
	// stops, with an error matching
	// ErrGroupLimit in its log lines and Ready. Defaults 65536 and 64 MiB.
	MaxHeldEffects int
	MaxHeldBytes   int
	// LegacyScope is the scope that wrote state saved before fence scopes
	// (one value holding the position and every partition's fence),
	// normally the job stream's prefix. New then converts that state in
	// place: its fences become this scope's. Without it New refuses such
	// state (ErrLegacyState). Once converted, the setting is no longer
	// needed.
	LegacyScope string

	// Handler, when set, receives each accepted effect, in log order,
	// instead of the republish. It must be idempotent by the effect's
	// scope and idempotency key: after a crash, effects handled since the
	// last saved position are handed over again. An error is retried,
	// up to MaxDeliveries tries; one matching ErrPoison moves the effect
	// to the dead-letter stream at once.
	Handler func(ctx context.Context, e sink.Effect) error
	// BatchHandler, when set, receives the accepted effects of each batch
	// the runner fetched, in log order, in calls of at most HandlerBatch
	// effects that never split a job, instead of the republish: for
	// destinations where one write of many effects costs about what one
	// write of one does (a KV sink's atomic batch, one database
	// transaction). The same idempotency rule as Handler's holds, and an
	// error fails the whole call: the runner then hands the effects from
	// that call on over again one per call, so that the error of each is
	// its own (see MaxDeliveries). Set Handler or BatchHandler, not both.
	BatchHandler func(ctx context.Context, effects []sink.Effect) error
	// Downstream is the stream accepted effects are republished into, with
	// Nats-Msg-Id set to the scope and the idempotency key ("<scope>
	// <key>"), so that the server drops a repeat of the same key in the
	// same scope, and only that. Default "<prefix>-fenced";
	// New creates it on "<prefix>.fenced.>" when it is missing. Its
	// duplicate window must be longer than AckWait plus the longest outage
	// you plan for, since a runner that crashes republishes what it had
	// not saved.
	Downstream string
	// Subject maps an effect's log subject to its republish subject.
	// Default: "<prefix>.out.X" becomes "<prefix>.fenced.X".
	Subject func(logSubject string) string
	// AtomicJobs republishes a job's effects on a subject (up to 1000) in
	// one JetStream atomic batch, so that a reader of the downstream
	// stream sees all of them or none; without it they go one by one, and
	// a reader may see part of a job until the rest arrives. It needs a
	// downstream stream that allows atomic publish (nats-server 2.12 or
	// later): New creates it so, and fails on one that does not. A batch
	// costs a round trip, and on a stream of one replica nats-server
	// stages each in a file of its own: jobs of three effects republished
	// at 566 effects/s that way against 32,629 one by one, and on three
	// replicas at 16,236 against 23,970 (BenchmarkRepublishJobs). For
	// republishing only (no Handler or BatchHandler).
	AtomicJobs bool

	// HandlerBatch is the most effects one BatchHandler call holds,
	// except for a job whose effects are more: they come in one call of
	// their own. Default Batch, and at most 100. Set it to the most the
	// destination takes in one atomic write (kvsink.MaxBatch).
	HandlerBatch int

	// MaxDeliveries bounds how often the runner tries to deliver an
	// accepted effect (the Handler, the BatchHandler or the republish)
	// before it moves it to the dead-letter stream, reports it
	// sink.DeadLettered and goes on. The waits between tries double up to
	// MaxBackoff: with the defaults, 10 tries take about 4.5 seconds. A
	// failure the destination marks sink.ErrUnavailable (pgsink does, for
	// a database unreachable or restarting) is not counted, as NATS's own
	// are not (below): an effect goes there for what it is, not for the
	// destination being away. A BatchHandler's
	// error fails its whole call: after one, the runner hands the effects
	// from that call on over one by one (calls of one), so that only the
	// effect that fails is moved. An effect that can never be delivered (a
	// republish larger than the server's max payload once the sink's
	// headers are added, or a handler's error matching ErrPoison) goes
	// there at once. A failure that is NATS's own (the connection is
	// down, or the server answers that it cannot serve yet: no
	// responders, a timeout, JetStream not ready) is retried without
	// being counted, so that a NATS restart moves nothing; a runner held
	// up by one shows in Ready. The count is kept in memory, per log
	// position, and reset by a success: a restarted runner starts it
	// over. Only delivery counts: reading the lease bucket (verified
	// epochs) and saving the progress are retried until they succeed,
	// and Ready reports a runner held up by them (StallAfter). Default 10.
	MaxDeliveries int
	// DeadLetter is the sink's dead-letter stream. Default
	// "<prefix>-sink-dlq"; New creates it on "<prefix>.sinkdlq.>" when
	// it is missing. Each dead letter is published on DeadLetterSubject
	// with the effect's data, its stamp, its other leasehold headers and
	// its trace context (no Nats- header), and the Leasehold-Sink-*
	// headers (HeaderSinkName and the others) that name the sink, the
	// log, the effect's subject and position, the tries and the error. An
	// effect is counted as handled once its dead letter is stored; after
	// a crash before its progress was saved, it may be stored twice.
	DeadLetter string
	// DeadLetterSubject is the subject of the runner's dead letters.
	// Default "<prefix>.sinkdlq.<consumer>".
	DeadLetterSubject string
	// StallAfter is how long Run may go without finishing a step (a
	// batch handled and saved, or a fetch that found nothing), or within
	// a step that has not failed without delivering an effect, before
	// Ready reports it stalled: its retries of the lease bucket, of the
	// state bucket or of NATS, or a hung handler, keep it from advancing.
	// A slow handler that delivers effects advances. Default 2 minutes.
	StallAfter time.Duration

	// Batch is how many messages one fetch asks for, and the most one
	// batch handles. While a batch is handled, the next one is fetched:
	// a runner holds up to two batches unacked, of the consumer's
	// MaxAckPending of four. Each batch ends with one save of the
	// position, a round trip: larger batches take fewer under load.
	// Default 400.
	Batch int
	// FetchWait is how long a fetch stays open, and how long Run waits
	// for a message before it counts an empty step. Default 500ms.
	FetchWait time.Duration
	// AckWait is how long the server waits for an ack before it redelivers
	// a message. Default 30s.
	AckWait time.Duration
	// MaxBackoff caps the wait between retries while NATS is away.
	// Default 2s.
	MaxBackoff time.Duration
	// Replicas of the streams and bucket New creates. Default 1.
	Replicas int
	// RequestTimeout bounds one request. Default 5s.
	RequestTimeout time.Duration

	// Name names the sink in decisions and logs. Default "stream".
	Name string
	// Verifier, when set, turns on verified epochs (see sink.EpochCheck).
	Verifier sink.Verifier
	// Progress reads partitions' committed progress from their fence
	// records: the proof that an attempt of a job the runner holds open
	// never completes (see groups.go). With it, job markers (aborts,
	// attempt numbers) prove nothing on their own, and none, whoever sends
	// it, drops a job its worker committed.
	// Default: the Verifier, when it is one (*coordinator.Bucket is).
	// Without either, markers and epochs are trusted as the worker writes
	// them.
	Progress sink.ProgressReader
	// Observer receives every decision, after it is saved. Optional.
	Observer sink.Observer
	// Logger receives drop lines and retries. Default slog.Default().
	Logger *slog.Logger
	// Telemetry selects the providers of the runner's spans and metrics:
	// a consumer span "process <subject template>" for each message it
	// decides, the child of the span that published the message. Zero
	// fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

func (c *Config) setDefaults() {
	if c.Prefix == "" {
		c.Prefix = "leasehold"
	}
	if c.Stream == "" {
		c.Stream = c.Prefix + "-effects"
	}
	if len(c.Subjects) == 0 {
		c.Subjects = []string{c.Prefix + ".out.>"}
	}
	if c.Consumer == "" {
		c.Consumer = c.Prefix + "-sink"
	}
	if c.StateBucket == "" {
		c.StateBucket = c.Prefix + "-sink-state"
	}
	if c.Downstream == "" {
		c.Downstream = c.Prefix + "-fenced"
	}
	if c.Subject == nil {
		from, to := c.Prefix+".out.", c.Prefix+".fenced."
		c.Subject = func(s string) string {
			if rest, ok := strings.CutPrefix(s, from); ok {
				return to + rest
			}
			return to + s
		}
	}
	if c.Batch == 0 {
		c.Batch = 400
	}
	if c.FetchWait == 0 {
		c.FetchWait = 500 * time.Millisecond
	}
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 2 * time.Second
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 5 * time.Second
	}
	if c.Name == "" {
		c.Name = "stream"
	}
	if c.MaxFences == 0 {
		c.MaxFences = DefaultMaxFences
	}
	if c.MaxHeldEffects == 0 {
		c.MaxHeldEffects = 1 << 16
	}
	if c.MaxHeldBytes == 0 {
		c.MaxHeldBytes = 64 << 20
	}
	if c.HandlerBatch == 0 {
		c.HandlerBatch = min(c.Batch, 100)
	}
	if c.MaxDeliveries == 0 {
		c.MaxDeliveries = 10
	}
	if c.DeadLetter == "" {
		c.DeadLetter = c.Prefix + "-sink-dlq"
	}
	if c.DeadLetterSubject == "" {
		c.DeadLetterSubject = c.Prefix + ".sinkdlq." + c.Consumer
	}
	if c.StallAfter == 0 {
		c.StallAfter = 2 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Progress == nil {
		c.Progress, _ = c.Verifier.(sink.ProgressReader)
	}
}

// Validate reports every problem with c.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	for what, name := range map[string]string{"stream": c.Stream, "consumer": c.Consumer, "state bucket": c.StateBucket, "downstream stream": c.Downstream, "dead-letter stream": c.DeadLetter} {
		if !validName(name) {
			errs = append(errs, fmt.Errorf("%s name %q: use letters, digits, '-' and '_'", what, name))
		}
	}
	if c.Handler != nil && c.BatchHandler != nil {
		errs = append(errs, errors.New("set Handler or BatchHandler, not both"))
	}
	if c.AtomicJobs && (c.Handler != nil || c.BatchHandler != nil) {
		errs = append(errs, errors.New("AtomicJobs is for republishing into the downstream stream: a Handler or BatchHandler writes each job as its destination allows"))
	}
	if c.Handler == nil && c.BatchHandler == nil && c.Downstream == c.Stream {
		errs = append(errs, errors.New("the downstream stream is the effect log itself: republished effects would be consumed again"))
	}
	if c.Batch < 1 || c.Batch > 1000 {
		errs = append(errs, fmt.Errorf("batch %d: use 1 to 1000", c.Batch))
	}
	if c.FetchWait < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("fetch wait %v: use at least 10ms", c.FetchWait))
	}
	if c.AckWait < time.Second {
		errs = append(errs, fmt.Errorf("ack wait %v: use at least 1s", c.AckWait))
	}
	if c.MaxBackoff <= 0 || c.RequestTimeout <= 0 {
		errs = append(errs, errors.New("max backoff and request timeout must be positive"))
	}
	if c.DeadLetter == c.Stream || c.DeadLetter == c.Downstream {
		errs = append(errs, errors.New("the dead-letter stream must be a stream of its own"))
	}
	if c.HandlerBatch < 1 || c.HandlerBatch > 10000 {
		errs = append(errs, fmt.Errorf("handler batch %d: use 1 to 10000", c.HandlerBatch))
	}
	if c.MaxDeliveries < 1 || c.MaxDeliveries > 1000 {
		errs = append(errs, fmt.Errorf("max deliveries %d: use 1 to 1000", c.MaxDeliveries))
	}
	if c.StallAfter < 0 {
		errs = append(errs, fmt.Errorf("stall after %v: use a positive time", c.StallAfter))
	}
	if c.MaxHeldEffects < 0 || c.MaxHeldBytes < 0 {
		errs = append(errs, errors.New("max held effects and bytes must not be negative (0 means the default)"))
	}
	if c.MaxFences < 1 || c.MaxFences > MaxFencesLimit {
		errs = append(errs, fmt.Errorf("max fences %d: use 1 to %d", c.MaxFences, MaxFencesLimit))
	}
	if c.LegacyScope != "" {
		if err := leasehold.ValidateScope(c.LegacyScope); err != nil {
			errs = append(errs, fmt.Errorf("legacy scope %q: %w", c.LegacyScope, err))
		}
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("replicas %d: use 1, 3 or 5", c.Replicas))
	}
	return errors.Join(errs...)
}

func validName(s string) bool {
	if s == "" || len(s) > 200 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}
