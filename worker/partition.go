package worker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
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
	committed  uint64 // progress committed through the lease
	finished   uint64 // every job up to here is done: handled, effects acknowledged
	handled    uint64 // the last job handled (its effects may be outstanding)
	window     []inflight
	retries    map[uint64]retryState
	lastCommit time.Time
	fetch      *fetcher
	pending    uint64 // jobs after the last one handled, as the consumer saw them
	attempts   uint64 // attempts run under the lease: the next one's number on the wire
	// after is, per subject, the last job of this lease that completed
	// with effects there: its next job's final names it (output.go).
	after map[string]uint64

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
		retries:  map[uint64]retryState{},
		after:    map[string]uint64{},
	}
	r.spans = newSpans(r)
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
	r.committed = r.lease.Progress()
	r.committedSeq.Store(r.committed)
	r.finished, r.handled = r.committed, r.committed
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
	r.event(r.ctx, Event{Kind: EventPartitionReady, Seq: r.committed})
	r.log.Debug("partition ready", "progress", r.committed)
	for {
		out := r.consume()
		switch out {
		case outRewind:
			continue
		case outStale:
			if out = r.stopped(); out == outRewind {
				continue
			}
		}
		r.end(out)
		return
	}
}

// consume handles jobs from the first one not done until the runner must
// stop or read again.
func (r *runner) consume() outcome {
	r.fetch = r.startFetch(r.finished + 1)
	defer func() {
		r.fetch.stop()
		r.fetch = nil
	}()
	r.handled = r.finished
	tick := time.NewTicker(r.w.cfg.CommitEvery)
	defer tick.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return outLost
		case <-r.draining:
			return outDrain
		default:
		}
		select {
		case <-r.ctx.Done():
			return outLost
		case <-r.draining:
			return outDrain
		case <-tick.C:
			r.w.tel.Metrics.SetLag(r.info.Holder, r.p, r.pending)
			if out := r.progress(); out != 0 {
				return out
			}
		case m := <-r.fetch.out:
			if out := r.handle(m); out != 0 {
				return out
			}
		}
	}
}

// progress reaps acknowledged effects and commits when it is time.
func (r *runner) progress() outcome {
	if seq, err := r.reap(r.ctx, false); err != nil {
		return r.rewind(seq, err)
	}
	if time.Since(r.lastCommit) >= r.w.cfg.CommitEvery {
		if err := r.commit(r.ctx); errors.Is(err, leasehold.ErrLeaseLost) {
			return outLost
		}
	}
	return 0
}

// handle runs one job; a zero outcome means: carry on.
func (r *runner) handle(m jetstream.Msg) outcome {
	md, err := m.Metadata()
	if err != nil {
		r.log.Error("job without JetStream metadata; skipping it", "subject", m.Subject(), "err", err)
		return 0
	}
	seq := md.Sequence.Stream
	if seq <= r.handled {
		return 0
	}
	r.pending = md.NumPending
	futs, done, out := r.runJob(m, md)
	if out != 0 {
		return out
	}
	r.handled = seq
	if len(futs) == 0 && len(r.window) == 0 {
		r.finished = seq
		if len(r.retries) > 0 {
			delete(r.retries, seq)
		}
	} else {
		r.window = append(r.window, inflight{seq: seq, runs: done.runs, futs: futs, sent: time.Now(), undo: done.undo})
	}
	if seq, err := r.reap(r.ctx, len(r.window) >= r.w.cfg.MaxInFlight); err != nil {
		if r.ctx.Err() != nil {
			return outLost
		}
		return r.rewind(seq, err)
	}
	return r.progress()
}

// completed is how a job's last attempt ended, for the window.
type completed struct {
	runs int         // attempts run
	undo []afterUndo // what its finals changed in the after map
}

// runJob runs the attempts of one job until it succeeds or is
// dead-lettered, and returns the publishes to wait for and how it ended.
func (r *runner) runJob(m jetstream.Msg, md *jetstream.MsgMetadata) ([]jetstream.PubAckFuture, completed, outcome) {
	seq := md.Sequence.Stream
	st := r.retries[seq]
	for !st.dead {
		if out := r.acquireSlot(); out != 0 {
			return nil, completed{}, out
		}
		st.runs++
		r.attempts++
		job := r.newJob(m, md, st.runs)
		job.wire = r.attempts
		ctx := context.WithValue(r.ctx, jobKey{}, job)
		ctx = r.w.tel.Propagator.Extract(ctx, telemetry.HeaderCarrier(job.Header))
		ctx, span := r.startProcess(ctx, job)
		ctx, cancel := context.WithTimeoutCause(ctx, r.w.cfg.HandleTimeout, ErrHandleTimeout)
		r.event(ctx, Event{Kind: EventJobStarted, Job: job, Seq: seq, Attempt: st.runs})
		start := time.Now()
		dog := r.watch(ctx, job, st, start)
		// An unreadable origin, or a roll-up that purged jobs before it:
		// whatever the handler, say so.
		err := beforeHandle(job)
		if err == nil {
			err = call(ctx, r.w.handler, job)
		}
		took := time.Since(start)
		hung := dog.done()
		err = attemptError(ctx, err)
		cancel()
		if hung {
			// Given up on: the partition is released, and the slot.
			r.measure(ctx, span, took, err)
			return nil, completed{}, outLost
		}
		r.releaseSlot()
		futs, effErr := job.close()
		if r.ctx.Err() != nil {
			// The lease is gone (or the drain ran out of time): the job is
			// not done, whatever the handler returned, and its held
			// effects never leave.
			r.measure(ctx, span, took, cmp.Or(err, effErr))
			return nil, completed{}, outLost
		}
		if err == nil {
			err = effErr
		}
		var undo []afterUndo
		if err == nil {
			futs, undo, err = job.finish(ctx, r.after)
		}
		r.measure(ctx, span, took, err)
		if err == nil {
			// The job's failure count stays until its effects are
			// acknowledged: an effect can still fail it.
			r.event(ctx, Event{Kind: EventJobFinished, Job: job, Seq: seq, Attempt: st.runs, Duration: took})
			return futs, completed{runs: st.runs, undo: undo}, 0
		}
		for i := len(undo) - 1; i >= 0; i-- {
			r.after[undo[i].subject] = undo[i].prev
		}
		r.abort(job, job.sentSubjects())
		if errors.Is(err, leasehold.ErrStaleEpoch) || errors.Is(err, leasehold.ErrLeaseLost) {
			r.event(ctx, Event{Kind: EventJobFailed, Job: job, Seq: seq, Attempt: st.runs, Err: err, Duration: took})
			r.log.Error("a sink refused this worker's epoch: another worker has taken the partition over; stopping it", "seq", seq, "err", err)
			return nil, completed{}, outStale
		}
		if r.counts(&st, err) {
			st.failures++
		}
		st.err = err
		st.dead = IsPermanent(err) || st.failures >= r.w.cfg.MaxAttempts
		var wait time.Duration
		if !st.dead {
			wait = r.w.cfg.Backoff(st.runs)
		}
		r.retries[seq] = st
		r.event(ctx, Event{Kind: EventJobFailed, Job: job, Seq: seq, Attempt: st.runs, Err: err, Duration: took, Backoff: wait})
		if !st.dead {
			r.log.Warn("job failed; retrying", "seq", seq, "attempt", st.runs, "backoff", wait, "err", err)
			if out := r.sleep(wait); out != 0 {
				return nil, completed{}, out
			}
		}
	}
	if st.dlqNonce == "" {
		st.dlqNonce = newNonce()
		r.retries[seq] = st
	}
	futs, out := r.deadLetter(m, md, st)
	return futs, completed{runs: st.runs}, out
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
		nonce:     newNonce(),
	}
}

func (r *runner) acquireSlot() outcome {
	if r.w.sem == nil {
		return 0
	}
	select {
	case r.w.sem <- struct{}{}:
		return 0
	case <-r.ctx.Done():
		return outLost
	case <-r.draining:
		return outDrain
	}
}

func (r *runner) releaseSlot() {
	if r.w.sem != nil {
		<-r.w.sem
	}
}

// sleep waits d, unless the runner must stop first.
func (r *runner) sleep(d time.Duration) outcome {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return 0
	case <-r.ctx.Done():
		return outLost
	case <-r.draining:
		return outDrain
	}
}

// stopped waits, after a sink refused this worker's epoch, for the lease to
// end. Should it outlive two TTLs (the refusal came from something other
// than a successor), the partition is read again from its progress.
func (r *runner) stopped() outcome {
	r.event(r.ctx, Event{Kind: EventPartitionStopped, Seq: r.handled})
	r.unwind()
	r.window = nil
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
	r.finished = r.committed
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
