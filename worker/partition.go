package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// runner handles one partition under one lease: it writes the barriers,
// then reads the partition's jobs from the committed progress on, runs them
// one at a time in sequence order, tracks their effects' acknowledgements,
// and commits progress through the lease. It ends on a drain (hand-off or
// shutdown), or when the lease is lost.
type runner struct {
	w       *Worker
	lease   *coordinator.Lease
	info    leasehold.Lease
	p       leasehold.Partition
	subject string // the partition's job subject
	output  string // its default output
	log     *slog.Logger
	spans   spans

	// ctx is the lease's context, also cancelled when a drain runs out of
	// time; handlers run under it.
	ctx    context.Context
	cancel context.CancelCauseFunc
	// detached is ctx without its cancellation (detachedCtx), made once.
	detached context.Context

	prev *runner       // the partition's previous runner in this worker, if any
	done chan struct{} // closed when run returns

	// abandoned is closed when its handler hung and the runner was given
	// up on (see hang.go).
	abandoned                chan struct{}
	abandonOnce, untrackOnce sync.Once

	dmu       sync.Mutex
	drainCtx  context.Context
	drainAt   time.Time
	draining  chan struct{} // closed when a drain is requested
	drainOnce sync.Once

	// Owned by the runner's goroutine.
	policy        policy   // the order it keeps and how many jobs run at once
	span          int      // jobs tracked from the watermark at most (Config.span)
	committed     uint64   // progress committed through the lease
	committedDone []uint64 // the done set committed with it
	// watermark: every job up to here is done (progress.go); doneSet:
	// the jobs done above it, ascending.
	watermark  uint64
	doneSet    []uint64
	fetched    uint64    // the furthest job read this round
	track      []*jobRun // the jobs read from the watermark on, in stream order
	window     []*jobRun // completed jobs not done yet, in completion order
	lanes      *lanes    // jobs waiting to start (lanes.go)
	live       int       // jobs whose goroutine runs
	badKeys    int       // jobs read whose order key did not parse
	ownBusy    bool      // the partition's own slot is taken
	spare      int       // pool slots handed over and not taken up yet
	retries    map[uint64]retryState
	lastCommit time.Time
	// commitFailed: the last commit failed; the next is the tick's.
	commitFailed bool
	fetch        *fetcher
	pending      uint64 // jobs after the last one read, as the consumer saw them
	// halt is closed when the round stops taking jobs, and stopping says
	// why (0 while it takes them).
	halt     chan struct{}
	stopping outcome
	// rewindAt is the job whose effect failed, and why, for a rewind.
	rewindAt struct {
		seq uint64
		err error
	}
	// after is, per subject, the last job of this lease that completed
	// with effects there: its next job's final names it (output.go).
	after map[string]uint64
	// replay is, after a rewind, the jobs whose finals this lease sent
	// and that are not done, in the order the runner completed them: they
	// run again in that order, one at a time, before any other job
	// (replay.go).
	replay []*jobRun
	// untracked are the jobs to replay, or replayed, that this round has
	// not read yet: reading one tracks it.
	untracked map[uint64]*jobRun
	// cancels are the partition's cancels, from a watch (cancel.go).
	cancels *cancels

	// Shared with the jobs' goroutines.
	reports chan report   // their reports
	gone    chan struct{} // closed when run returns
	wake    chan struct{} // a pool slot handed over (slots.go)
	// wire numbers the attempts run under the lease: an attempt's number
	// on the wire.
	wire atomic.Uint64

	// Read by the stall watch while the runner's goroutine works.
	progressAt   atomic.Int64  // unix nanoseconds of the last progress, or of being caught up
	committedSeq atomic.Uint64 // committed, for reports
}

// retryState follows a job across attempts and re-reads.
type retryState struct {
	runs     int   // attempts run
	failures int   // attempts that count towards MaxAttempts
	err      error // the last failure
	dead     bool  // the job is to be dead-lettered
	snoozes  int   // times its handler snoozed it (snooze.go)
	// transientSince is when the job's effects first failed for the
	// transport's reasons; such failures use up no attempt until they
	// have gone on for Config.TransientFor, and then only as counts
	// (breaker.go) says.
	transientSince time.Time
	dlqNonce       string // the dead letter's message ID nonce, kept across re-sends
}

type outcome int

const (
	outDrain  outcome = iota + 1 // a drain was requested
	outLost                      // the lease is gone (or the drain ran out of time)
	outStale                     // a sink refused this worker's epoch
	outRewind                    // an effect failed: read again from the first job not done
)

var errRunnerDone = errors.New("worker: partition runner ended")

func newRunner(w *Worker, l *coordinator.Lease, prev *runner) *runner {
	ctx, cancel := context.WithCancelCause(l.Context())
	p := l.Partition()
	r := &runner{
		w:        w,
		lease:    l,
		info:     l.Info(),
		p:        p,
		subject:  JobSubject(w.cfg.Prefix, p),
		output:   OutputSubject(w.cfg.Prefix, p),
		log:      w.log.With("partition", p, "epoch", l.Epoch()),
		ctx:      ctx,
		cancel:   cancel,
		prev:     prev,
		done:     make(chan struct{}),
		draining: make(chan struct{}),
		policy:   w.cfg.partitionPolicy(),
		span:     w.cfg.span(),
		retries:  map[uint64]retryState{},
		after:    map[string]uint64{},
		reports:  make(chan report),
		gone:     make(chan struct{}),
		wake:     make(chan struct{}, 1),
	}
	r.initSpans()
	r.abandoned = make(chan struct{})
	return r
}

func (r *runner) event(ctx context.Context, e Event) {
	if r.w.cfg.Observer == nil {
		return
	}
	e.Lease = r.info
	e.Time = time.Now()
	if e.Job != nil && e.WireAttempt == 0 {
		e.WireAttempt = e.Job.wire
	}
	r.w.cfg.Observer.WorkerEvent(ctx, e)
}

// drain asks the runner to stop taking jobs, finish the one in flight,
// wait for its effects and commit, and waits until it has, or until ctx
// ends: then the handlers are cancelled and drain returns at once.
func (r *runner) drain(ctx context.Context) {
	r.drainOnce.Do(func() {
		r.dmu.Lock()
		r.drainCtx, r.drainAt = ctx, time.Now()
		r.dmu.Unlock()
		r.event(r.ctx, Event{Kind: EventPartitionRevoked})
		close(r.draining)
	})
	select {
	case <-r.done:
	case <-ctx.Done():
		r.cancel(fmt.Errorf("worker: partition %d: the drain ran out of time: %w", r.p, context.Cause(ctx)))
	}
}

func (r *runner) drainContext() (context.Context, time.Time) {
	r.dmu.Lock()
	defer r.dmu.Unlock()
	return r.drainCtx, r.drainAt
}

func (r *runner) run() {
	defer close(r.done)
	defer close(r.gone)
	defer r.w.pool.leave(r.wake)
	defer r.cancel(errRunnerDone)
	if r.prev != nil {
		// The previous lease on this partition is gone; its runner only
		// settles what it started, unless its handler hung.
		select {
		case <-r.prev.done:
		case <-r.prev.abandoned:
		}
		r.prev = nil
	}
	// Report a loss when it happens, not when the runner gets to it: a
	// handler may keep the runner busy long after.
	stop := context.AfterFunc(r.lease.Context(), func() {
		if cause := context.Cause(r.lease.Context()); !errors.Is(cause, coordinator.ErrReleased) {
			r.event(context.Background(), Event{Kind: EventPartitionLost, Err: cause})
			r.log.Warn("partition lost; its handlers are cancelled", "cause", cause)
		}
	})
	defer stop()
	c := r.lease.Committed()
	r.committed, r.committedDone = c.Seq, c.Done
	r.committedSeq.Store(r.committed)
	r.watermark, r.doneSet = c.Seq, slices.Clone(c.Done)
	if h, ok := r.w.recallHang(r.p, r.committed); ok {
		// The job hung here before: its failures count on.
		r.retries[h.seq] = retryState{runs: h.failures, failures: h.failures, err: h.err, dead: h.failures >= r.w.cfg.MaxAttempts}
	}
	r.lastCommit = time.Now()
	r.touch()
	select {
	case <-r.draining:
		r.end(outDrain) // revoked before it started
		return
	default:
	}
	if out := r.writeBarriers(); out != 0 {
		r.end(out)
		return
	}
	cancels, out := r.watchCancels()
	if out != 0 {
		r.end(out)
		return
	}
	r.cancels = cancels
	defer r.cancels.stop()
	r.event(r.ctx, Event{Kind: EventPartitionReady, Seq: r.committed, Done: r.committedDone})
	r.log.Debug("partition ready", "progress", r.committed, "done", len(r.committedDone))
	for {
		out := r.consume()
		switch out {
		case outRewind:
			if out = r.rewind(r.rewindAt.seq, r.rewindAt.err); out == outRewind {
				continue
			}
		case outStale:
			if out = r.stopped(); out == outRewind {
				continue
			}
		}
		r.end(out)
		return
	}
}

// progress reaps acknowledged effects and commits when it is time.
func (r *runner) progress() outcome {
	if seq, err := r.reap(r.ctx, false); err != nil {
		return r.failed(seq, err)
	}
	if time.Since(r.lastCommit) >= r.w.cfg.CommitEvery {
		if err := r.commit(r.ctx); errors.Is(err, leasehold.ErrLeaseLost) {
			return outLost
		}
	}
	return 0
}

// failed notes the job whose effect failed, for the rewind once the round
// has stopped.
func (r *runner) failed(seq uint64, err error) outcome {
	if r.ctx.Err() != nil {
		return outLost
	}
	r.rewindAt.seq, r.rewindAt.err = seq, err
	return outRewind
}

// measure records one attempt's outcome on its span, which it ends, and in
// the job metrics.
func (r *runner) measure(ctx context.Context, span trace.Span, took time.Duration, err error) {
	m := r.w.tel.Metrics
	m.HandlerDuration.Record(ctx, took.Seconds())
	if err == nil && r.ctx.Err() != nil {
		// The lease is gone: the job is not done, whatever the handler
		// returned.
		err = context.Cause(r.ctx)
	}
	if err == nil {
		m.JobsProcessed.Add(ctx, 1)
	} else {
		m.JobsFailed.Add(ctx, 1)
	}
	endSpan(span, err)
}

func (r *runner) newJob(m jetstream.Msg, md *jetstream.MsgMetadata, attempt int) *Job {
	h := m.Headers()
	return &Job{
		Data:      m.Data(),
		Header:    h,
		Subject:   m.Subject(),
		Seq:       md.Sequence.Stream,
		Partition: r.p,
		Attempt:   attempt,
		Lease:     r.info,
		ID:        jobIDOf(h),
		Enqueued:  md.Timestamp,
		r:         r,
		nonce:     newNonceBytes(),
	}
}

// sleep waits d, unless the runner must stop first, or halt (nil: never)
// is closed.
func (r *runner) sleep(d time.Duration, halt <-chan struct{}) outcome {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return 0
	case <-r.ctx.Done():
		return outLost
	case <-r.draining:
		return outDrain
	case <-halt:
		return outStale
	}
}

// stopped waits, after a sink refused this worker's epoch, for the lease to
// end. Should it outlive two TTLs (the refusal came from something other
// than a successor), the partition is read again from its progress.
func (r *runner) stopped() outcome {
	r.event(r.ctx, Event{Kind: EventPartitionStopped, Seq: r.watermark})
	r.unwind()
	t := time.NewTimer(2 * r.w.ttl)
	defer t.Stop()
	select {
	case <-r.ctx.Done():
		return outLost
	case <-r.draining:
		return outStale
	case <-t.C:
	}
	r.log.Warn("partition refused as stale but its lease is still held; reading it again from its progress", "progress", r.committed)
	// A sink may have refused effects of jobs finished since the last
	// commit: they run again.
	r.watermark, r.doneSet = r.committed, slices.Clone(r.committedDone)
	clear(r.retries)
	return outRewind
}

// end settles and commits what is done, then reports how the partition
// ended. After a stale refusal nothing is committed.
func (r *runner) end(out outcome) {
	dctx, drainAt := r.drainContext()
	switch {
	case out == outStale:
		r.event(r.ctx, Event{Kind: EventPartitionDrained, Seq: r.committed, Duration: since(drainAt)})
		return
	case out == outDrain && r.ctx.Err() == nil && dctx != nil:
		r.settle(dctx)
		_ = r.commit(dctx)
		r.event(r.ctx, Event{Kind: EventPartitionDrained, Seq: r.committed, Duration: since(drainAt)})
		r.log.Debug("partition drained", "progress", r.committed, "took", since(drainAt))
		return
	}
	switch {
	case r.lease.Err() != nil:
		// The loss is logged when it happens.
	case dctx != nil && dctx.Err() != nil:
		r.log.Warn("the drain ran out of time; its handlers are cancelled", "cause", context.Cause(dctx))
	default:
		// No drain was asked, or it has time left: the runner stopped for
		// its own reason (a refused commit, a hung handler), logged where
		// it arose.
		r.log.Debug("partition runner stopped; its handlers are cancelled", "cause", context.Cause(r.ctx))
	}
	// Jobs finished before the loss may still be committed: the commit is
	// a compare-and-set that fails if a successor has fenced the partition.
	ctx, cancel := context.WithTimeout(context.Background(), r.w.cfg.EffectTimeout)
	defer cancel()
	r.settle(ctx)
	_ = r.commit(ctx)
	if !drainAt.IsZero() {
		r.event(context.Background(), Event{Kind: EventPartitionDrained, Seq: r.committed, Duration: since(drainAt), Err: context.Cause(r.ctx)})
	}
}

func since(t time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return time.Since(t)
}
