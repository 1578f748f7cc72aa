// Package streamsink is a leasehold sink over a JetStream effect log.
//
// Workers publish their effects, stamped, into a stream (by default
// "<prefix>-effects" on "<prefix>.out.>"). A Runner consumes that log in
// order with a durable consumer, judges each effect against its fence (one
// per scope and partition: any number of job streams and locks share one
// log), and either republishes the accepted ones into a downstream stream
// (Nats-Msg-Id = scope and idempotency key, so a repeat is dropped by the
// server) or hands them to a function. A stale effect, a split-brain one
// (an epoch's second acquisition), a bad stamp, an unverified epoch and an
// effect beyond the fence limit are terminated (Term): never redelivered,
// never applied, counted and reported. An accepted effect that its
// destination keeps refusing is moved to the sink's dead-letter stream
// after Config.MaxDeliveries tries, reported sink.DeadLettered, and the
// runner goes on.
//
// A barrier (a message with the leasehold.HeaderBarrier header, published
// by a worker when it acquires a partition) raises the fence at its place
// in the log. The runner learns take-overs from barriers and from nothing
// else: an earlier holder's effect published before the barrier may be
// committed progress, and refusing it would lose it. So each message is
// judged against the fences as they stood at its log position.
//
// A job's effects apply all or none. Effects a worker publishes for a job
// (leasehold.HeaderJob and the other job headers: leasehold.JobMark) are
// held back, by fence, subject, lease, job and attempt, until one
// attempt's final and every effect it counts are in the log and the job
// before it on the subject was applied; then that attempt's effects are
// delivered together (one BatchHandler call, one republish round) and the
// job's other attempts are dropped, reported sink.Aborted. Markers prove
// nothing on their own: an abort marker concerns its own attempt only, an
// attempt number supersedes no other attempt, and an attempt is dropped
// only on proof that it can no longer complete: its job applied from
// another attempt, a successor's stamp admitted on its fence, or its
// partition's committed progress, read from the fence record
// (Config.Progress; by default the Verifier). So no abort marker, no
// attempt number and no final's Leasehold-Floor, whoever sends it, drops
// a job the worker committed or makes it a duplicate: a job's effects are
// duplicates only once the job was applied, or the record shows it
// committed and the runner has read every effect its lease committed it
// with (chains.go); a marker the runner can tell is not a worker's is set aside,
// counted in leasehold_sink_markers_suspicious_total, logged, and marked
// on its decision (sink.Decision.Suspect, the Suspect* reasons). Without
// a progress reader (no Verifier), markers and epochs are trusted as the
// worker writes them: an abort closes its own attempt, and a complete
// attempt applies whatever attempts came before it. Whoever may publish on
// the log with a worker's stamp can still make effects up (data of its own
// under keys it picks), as with effects that carry no job: only the log's
// permissions keep that out.
//
// A job counts as applied once its effects were delivered: one whose
// delivery went to the dead-letter stream stays open for its dead letters,
// which apply on their own when they are replayed into the log, with their
// job headers or without. The saved position stops short of the first
// effect of a job still open, and where each fence and subject stands (its
// floor and the jobs applied above it, the dead-lettered ones) is saved
// beside it, so a restart finds open jobs again and applies no job twice.
// Held effects are bounded (Config.MaxHeldEffects and MaxHeldBytes,
// ErrGroupLimit), and so are the jobs a chain remembers above its floor. Effects
// without job headers apply on their own. See groups.go, attempts.go and
// proofs.go.
//
// A worker may send an attempt's effects on a subject packed in one log
// message (leasehold.HeaderPack). The runner expands it, at its log
// position, into the effects it holds, each stamped and marked as it
// would have been alone, and decides them as if they had come so; the
// message is acked once, and a malformed one is refused whole as a bad
// stamp (see packed.go). Every runner reading a log is upgraded before
// workers pack effects into it: a runner of a release before packs takes a
// packed message for one effect, its last, with the packed body for data,
// and its job never holds all the effects its final counts, so it never
// applies.
//
// Progress is crash-safe. After each batch the runner saves the fence
// shards the batch changed (most batches change none), then the last log
// position it handled, and only then acks. A runner that dies mid-batch
// leaves the position unsaved and the batch unacked; the next one decides
// the batch again from the saved position, against the fences as they
// stood there (entries a dead runner saved above it are ignored), reaching
// the same decisions, and its republishes are dropped as duplicates.
// Messages at or below the saved position are acked without a second
// decision, so a batch's decisions are reported before its position is
// saved: a crash between the two reports them again, never loses them
// (a refusal is counted at least once). Messages that arrive out of order (redeliveries after a
// crash) are put back in order by reading the log. Nothing is applied
// twice or lost. The runner fetches the next batches while it handles
// one (see prefetch.go); fetching changes no state, and a runner that
// stops hands what it holds back to the server, while one that dies
// leaves it to be redelivered or read from the log. The saved state is
// bounded: see Config.MaxFences.
//
// The log must keep every message until the runner has handled it: a
// message removed before, by the log's limits (MaxAge, MaxMsgs, MaxBytes,
// MaxMsgsPerSubject, message TTLs, a work-queue or interest retention) or
// by hand, may be a take-over's barrier. The log Config.Provision creates
// has no limits and denies deletes and purges. New refuses a log with
// limits unless Config.AllowTrimming, and Runner.Retention then states how
// far behind the runner may fall. A runner that finds messages gone stops
// at the gap (ErrGap): it applies nothing past it, says so in an ERROR
// line, the leasehold_sink_gap gauge and Ready, and goes on only when an
// operator resumes it (Runner.ResumeAfterGap, `leasehold sink
// --resume-gap`). A runner whose Config.FilterSubject covers part of the
// log cannot tell whether removed messages were its own, since the server
// keeps no record of them, and stops at every gap among the positions it
// has not passed: give it a log that nothing trims, or a log of its own.
package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/sink"
)

// Runner consumes an effect log and applies it under the fence.
type Runner struct {
	// packsOneByOne, set by tests that decide the same messages both
	// ways and compare the decisions, keeps decidePacked from taking a
	// packed message in one step.
	packsOneByOne bool

	js      jetstream.JetStream
	cfg     Config
	cons    jetstream.Consumer
	stateKV jetstream.KeyValue
	state   *leader.Reader // the state bucket's stream, through its leader
	filter  string
	leader  *leader.Reader
	rep     *sink.Reporter
	check   *sink.EpochCheck
	log     *slog.Logger

	// hook, when set by tests, runs at named points of a batch; an error
	// stops Run there, as a crash would.
	hook func(point string) error

	retention Retention        // what the log's settings can remove
	logFirst  uint64           // the log's first sequence as configured: none below it ever existed
	logStream jetstream.Stream // the effect log, for its state
	wholeLog  bool             // the consumer's filter covers every subject of the log
	// deliveredAt is when the runner last delivered an effect (unix
	// nanoseconds), for Ready: a batch that delivers advances.
	deliveredAt atomic.Int64
	// atomicOut: with Config.AtomicJobs, a job's effects are republished
	// in one atomic batch (see republishJobs), until the downstream stream
	// refuses batches as disabled.
	atomicOut atomic.Bool

	// stepMu is held by Run for each batch and by ResumeAfterGap, which
	// both move the saved position.
	stepMu sync.Mutex
	skips  []skip           // the operators' resumes the position record keeps
	tries  map[effectAt]int // failed deliveries by effect; deadLettered once moved

	// Job groups (groups.go), owned by Run's goroutine, and what the
	// fence records proved of them (proofs.go).
	groups       *groups
	proofs       *proofs
	saved        uint64                // the saved position: seq, or short of the first effect of an open job
	appliedRev   map[int]uint64        // revisions of the applied shards
	needReload   bool                  // a batch that placed effects in groups was not saved
	unsaved      map[uint64][]reported // decisions reported in batches whose save failed, by log position
	outs         []outcome             // room for a batch's outcomes, empty between batches (keepOuts)
	forgotLogged time.Time             // when jobs forgotten at a chain's bound were last logged

	// lastPull is when the fetcher last began a pull (unix nanoseconds),
	// for Ready: a fetcher held up leaves Run nothing to take, which
	// looks to Run like a quiet log.
	lastPull atomic.Int64
	// Messages the fetcher's subscription dropped (it was full), and when
	// it last did (Unix nanoseconds); see prefetch.go.
	dropped, droppedAt atomic.Int64

	mu         sync.Mutex
	heldCount  int // effects held in open groups, for the gauge
	aboveCount int // jobs the chains hold above their floors, for the gauge
	// Open groups whose job the records settled (proofs.go, noteStuck):
	// how many, since when the oldest, and which.
	stuckCount int
	stuckSince time.Time
	stuckFirst groupKey
	forgotten  int64         // jobs the chains forgot at their bound (chains.go)
	seq        uint64        // the position decided and saved (see saved)
	rev        uint64        // the position record's revision; only Run's goroutine uses it
	fences     *fenceTable   // as of seq
	progress   chan struct{} // closed and replaced when seq advances
	running    bool
	lastOK     time.Time     // when Run last finished a step without error
	lastErr    error         // the error of the last failed step, nil after a good one
	gap        *GapError     // the gap Run stopped at, until resumed
	resumed    chan struct{} // closed and replaced on a resume past a gap
}

// New prepares a runner: it finds the effect log (or creates it, with
// Config.Provision) and checks what its settings can remove (see
// Retention), creates the downstream stream, the dead-letter stream, the
// state bucket and the durable consumer when they are missing, and loads
// the saved progress.
func New(ctx context.Context, js jetstream.JetStream, cfg Config) (*Runner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("streamsink: invalid config: %w", err)
	}
	cfg.setDefaults()
	r := &Runner{
		js: js, cfg: cfg, leader: leader.NewReader(js, cfg.Stream), log: cfg.Logger,
		rep:      sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check:    sink.NewEpochCheck(cfg.Verifier),
		proofs:   newProofs(cfg.Progress),
		progress: make(chan struct{}),
		resumed:  make(chan struct{}),
		tries:    make(map[effectAt]int),
		filter:   cfg.FilterSubject,
	}
	if r.filter == "" {
		r.filter = ">"
	}
	if err := r.provision(ctx); err != nil {
		return nil, err
	}
	if max := js.Conn().MaxPayload(); max > 0 && max < shardBytes+4096 {
		return nil, fmt.Errorf("streamsink: the server's max payload of %d bytes is below the %d a shard of the runner's saved fences may take: raise max_payload (default 1 MiB)", max, shardBytes+4096)
	}
	st, err := retry.Value(ctx, r.loadState)
	if err != nil {
		return nil, err
	}
	r.seq, r.saved, r.rev, r.fences, r.skips = st.seq, st.seq, st.rev, st.fences, st.skips
	ap, err := retry.Value(ctx, r.loadApplied)
	if err != nil {
		return nil, err
	}
	r.adoptApplied(ap, st.delta)
	r.aboveCount = r.groups.above
	if err := r.registerFetchMetrics(); err != nil {
		return nil, err
	}
	if err := r.registerGauges(); err != nil {
		return nil, err
	}
	if st.legacy {
		// Convert at once, so that a runner built before fence scopes
		// finds state it refuses rather than state it would trust.
		written, err := r.save(ctx, &work{seq: st.seq})
		if err != nil {
			return nil, fmt.Errorf("streamsink: convert the progress saved before fence scopes: %w", err)
		}
		r.fences.commit(&work{}, written, st.seq)
		r.log.LogAttrs(ctx, slog.LevelInfo, "streamsink: converted progress saved before fence scopes",
			slog.String("sink", cfg.Name), slog.String("scope", cfg.LegacyScope), slog.Int("fences", len(r.fences.fences)), slog.Uint64("position", st.seq))
	}
	return r, nil
}

func (r *Runner) provision(ctx context.Context) error {
	cfg := r.cfg
	if err := r.provisionLog(ctx); err != nil {
		return err
	}
	if err := r.provisionDeadLetter(ctx); err != nil {
		return err
	}
	if cfg.Handler == nil && cfg.BatchHandler == nil {
		down, err := retry.Value(ctx, r.lookup(cfg.Downstream))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			down, err = r.create(ctx, jetstream.StreamConfig{
				Name: cfg.Downstream, Subjects: []string{cfg.Prefix + ".fenced.>"}, Storage: jetstream.FileStorage,
				Replicas: cfg.Replicas, Duplicates: 10 * time.Minute, Description: "leasehold fenced effects",
				AllowAtomicPublish: cfg.AtomicJobs,
			})
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				down, err = retry.Value(ctx, r.lookup(cfg.Downstream))
			}
			if err != nil {
				return fmt.Errorf("streamsink: create the downstream stream %s: %w", cfg.Downstream, err)
			}
		} else if err != nil {
			return fmt.Errorf("streamsink: look up the downstream stream %s: %w", cfg.Downstream, err)
		}
		if cfg.AtomicJobs {
			if !down.CachedInfo().Config.AllowAtomicPublish {
				return fmt.Errorf("streamsink: AtomicJobs: the downstream stream %s does not allow atomic publish: allow it (nats stream edit %s --allow-batch, nats-server 2.12 or later), or republish without AtomicJobs", cfg.Downstream, cfg.Downstream)
			}
			r.atomicOut.Store(true)
		}
	}
	bind := func(ctx context.Context) (jetstream.KeyValue, error) { return r.js.KeyValue(ctx, cfg.StateBucket) }
	kv, err := retry.Value(ctx, bind)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
			return r.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
				Bucket: cfg.StateBucket, History: 1, Storage: jetstream.FileStorage, Replicas: cfg.Replicas,
				Description: "leasehold stream sink progress",
			})
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = retry.Value(ctx, bind)
		}
	}
	if err != nil {
		return fmt.Errorf("streamsink: state bucket %s: %w", cfg.StateBucket, err)
	}
	r.stateKV = kv
	r.state = leader.NewReader(r.js, "KV_"+cfg.StateBucket)
	cc := jetstream.ConsumerConfig{
		Durable:       cfg.Consumer,
		Description:   "leasehold stream sink",
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       cfg.AckWait,
		MaxDeliver:    -1,
		MaxAckPending: 4 * cfg.Batch,
		FilterSubject: cfg.FilterSubject,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	cons, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		return r.js.CreateOrUpdateConsumer(ctx, cfg.Stream, cc)
	})
	if err != nil {
		return fmt.Errorf("streamsink: consumer %s on %s: %w", cfg.Consumer, cfg.Stream, err)
	}
	r.cons = cons
	return nil
}

func (r *Runner) lookup(name string) func(context.Context) (jetstream.Stream, error) {
	return func(ctx context.Context) (jetstream.Stream, error) { return r.js.Stream(ctx, name) }
}

// create creates a stream, retrying the server's transient refusals (10049
// right after a delete of the same name).
func (r *Runner) create(ctx context.Context, sc jetstream.StreamConfig) (jetstream.Stream, error) {
	return retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) { return r.js.CreateStream(ctx, sc) })
}

// Fence returns what the runner records for fence id as of the handled
// position: the zero FenceState if nothing.
func (r *Runner) Fence(id leasehold.FenceID) leasehold.FenceState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fences.fences[id].state()
}

// Fences returns how many fences the runner keeps (see Config.MaxFences).
func (r *Runner) Fences() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.fences.fences)
}

// Position returns the last log position handled and saved. While a job's
// effects are held open (see groups.go), the position saved for a restart
// stops short of the job's first effect, and a restart reads the log again
// from there.
func (r *Runner) Position() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seq
}

// WaitPosition waits until the runner has handled and saved log position
// seq.
func (r *Runner) WaitPosition(ctx context.Context, seq uint64) error {
	for {
		r.mu.Lock()
		done, ch := r.seq >= seq, r.progress
		r.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("streamsink: wait for log position %d: %w", seq, ctx.Err())
		case <-ch:
		}
	}
}

// Dropped returns how many effects of fence id were refused.
func (r *Runner) Dropped(id leasehold.FenceID) uint64 { return r.rep.Dropped(id) }

// Run consumes the log until ctx ends, retrying with backoff while NATS is
// away. At a gap in the log (see ErrGap) it stops applying and waits for
// ResumeAfterGap. It returns nil when ctx ends and ErrStateConflict when
// another runner saves progress under the same consumer name. One Run at a
// time.
func (r *Runner) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.running {
		r.mu.Unlock()
		return errors.New("streamsink: Run is already running")
	}
	r.running, r.lastOK, r.lastErr = true, time.Now(), nil
	r.lastPull.Store(time.Now().UnixNano())
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.running = false
		r.mu.Unlock()
	}()
	// The prefetcher ends at halt, not with ctx: halt says first whether
	// what it holds goes back to the server. Ended with ctx, a fetcher in
	// the middle of a pull would see the stop before it is told to hand
	// back, and drop that pull's messages to wait for AckWait.
	pf := r.startPrefetch(context.WithoutCancel(ctx))
	stopped := false // by a crash in a test: what it holds waits for AckWait
	defer func() { pf.halt(!stopped) }()
	failures := 0
	checked := false // the log's first position, against the saved one
	for ctx.Err() == nil {
		if gap, resumed := r.gapWait(); gap != nil {
			select {
			case <-ctx.Done():
			case <-resumed:
			}
			continue
		}
		r.stepMu.Lock()
		var err error
		if !checked {
			err = r.checkStart(ctx)
			checked = err == nil
		}
		if err == nil {
			err = r.step(ctx, pf)
		}
		// A gap is recorded before stepMu is let go, so that a resume
		// (which holds it) comes before the gap is met or after it is
		// recorded, never in between, where it would be undone.
		gap := (*GapError)(nil)
		if errors.As(err, &gap) && ctx.Err() == nil {
			r.stopAt(ctx, gap)
		}
		r.stepMu.Unlock()
		r.stepped(err)
		if err == nil {
			failures = 0
			continue
		}
		if errors.Is(err, errStop) {
			// A test's crash, even as its context ends.
			stopped = true
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrStateConflict) {
			return err
		}
		if gap != nil {
			continue
		}
		failures++
		wait := min(r.cfg.MaxBackoff, 10*time.Millisecond<<min(failures, 10))
		r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: retrying", slog.String("sink", r.cfg.Name),
			slog.Int("failures", failures), slog.Duration("wait", wait), slog.Any("error", err))
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	return nil
}

// stepped records how a step ended, for Ready.
func (r *Runner) stepped(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil {
		r.lastOK, r.lastErr = time.Now(), nil
	} else if !errors.Is(err, ErrGap) {
		r.lastErr = err
	}
}

// Ready returns nil while the runner is running and advancing: an error
// matching ErrGap while it is stopped at a gap, and an error saying it is
// stalled when its last step without an error (a batch handled and saved,
// or a fetch that found nothing) ended more than Config.StallAfter ago:
// reading the lease bucket, saving the progress, a handler or NATS itself
// has been failing or hanging since; or when its fetcher has begun no pull
// for that long after its last (Config.FetchWait). For a readiness probe.
func (r *Runner) Ready(context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gap != nil {
		return r.gap
	}
	if errors.Is(r.lastErr, ErrGroupLimit) {
		return r.lastErr
	}
	if err := r.progressStalled(); err != nil {
		return err
	}
	if err := r.stuckStalled(); err != nil {
		return err
	}
	if !r.running {
		return fmt.Errorf("streamsink: sink %s is not running", r.cfg.Name)
	}
	last := r.lastOK
	if at := time.Unix(0, r.deliveredAt.Load()); r.lastErr == nil && at.After(last) {
		// A long batch of a slow handler advances while it delivers:
		// 400 effects of 300 ms each take two minutes. After a failed
		// step it does not: deliveries that a failing save undoes each
		// time are no progress.
		last = at
	}
	if d := time.Since(last); d > r.cfg.StallAfter {
		why := "one batch has been in progress all that time, delivering nothing: a handler or a request that does not return"
		if r.lastErr != nil {
			why = "the last error: " + r.lastErr.Error()
		}
		return fmt.Errorf("streamsink: sink %s has made no progress for %v (Config.StallAfter %v) at log position %d; %s", r.cfg.Name, d.Round(time.Second), r.cfg.StallAfter, r.seq, why)
	}
	if err := r.fetchDropped(); err != nil {
		return err
	}
	if d := time.Since(time.Unix(0, r.lastPull.Load())); d > r.cfg.StallAfter+r.cfg.FetchWait {
		return fmt.Errorf("streamsink: sink %s has begun no fetch from %s for %v (Config.StallAfter %v after a FetchWait of %v) at log position %d: its fetcher is held up, and the runner sees a log with nothing to handle", r.cfg.Name, r.cfg.Stream, d.Round(time.Second), r.cfg.StallAfter, r.cfg.FetchWait, r.seq)
	}
	return nil
}

// errStop wraps a test hook's error.
var errStop = errors.New("streamsink: stopped")

// step takes the next batch from the prefetcher (see prefetch.go) and
// handles it.
func (r *Runner) step(ctx context.Context, p *prefetcher) error {
	if r.needReload {
		if err := r.reload(ctx); err != nil {
			return err
		}
	}
	r.poll(ctx)
	msgs, err := r.take(ctx, p)
	if err != nil {
		return err
	}
	if len(msgs) == 0 {
		return r.resolve(ctx)
	}
	return r.handle(ctx, msgs)
}
