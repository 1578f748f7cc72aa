package worker

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// Each job the runner starts runs its attempts in a goroutine of its own:
// the handler, the retries after its backoff (which hold up only the
// job's lane) and its dead letter. The goroutine reports to the runner's
// goroutine, which alone sends finals, touches the after map, tracks
// acknowledgements and commits: a handler that succeeded hands its attempt
// over and waits for the runner to send the finals (which can fail the
// attempt in turn); every other end is a report of its own. The runner
// counts the job as running until that last report, or until its handler
// is found hung.

// report is what a job's goroutine tells the runner.
type report struct {
	run  *jobRun
	kind reportKind
	st   retryState // the job's state after its last attempt

	// For reportSucceeded: the attempt, whose finals the runner sends,
	// and what the runner needs to account for it. The runner answers on
	// reply: nil when the finals are sent, or why the attempt failed.
	job   *Job
	ctx   context.Context
	span  trace.Span
	took  time.Duration
	reply chan error

	// For reportDeadLettered: the dead letter's settled publish.
	futs []jetstream.PubAckFuture
}

type reportKind uint8

const (
	reportSucceeded    reportKind = iota + 1 // the handler returned nil: send the finals
	reportDeadLettered                       // the job's dead letter is stored
	reportEnded                              // it stopped unfinished: lease lost, drain or rewind
	reportStale                              // a sink refused this worker's epoch
	reportHung                               // its handler did not return in time (sent by the watchdog)
)

// replies holds the channels a succeeded attempt's report is answered
// on: one per job otherwise.
var replies = sync.Pool{New: func() any { return make(chan error, 1) }}

// errHalted answers a succeeded attempt the runner does not complete: it
// is rewinding, stopping, or its lease is gone.
var errHalted = errors.New("worker: the partition stopped taking jobs")

// startJob starts j's attempts in a goroutine of its own.
func (r *runner) startJob(j *jobRun) {
	j.phase = phaseRunning
	r.live++
	r.w.tel.Metrics.JobsInFlight.Add(r.ctx, 1)
	go r.grownAttempts(j, r.retries[j.seq], r.halt)
}

// grownAttempts is attempts on a stack grown first (stack.go), before
// attempts' own frame is on it.
func (r *runner) grownAttempts(j *jobRun, st retryState, halt <-chan struct{}) {
	growStack()
	r.attempts(j, st, halt)
}

// tell hands rep to the runner's goroutine.
func (r *runner) tell(rep report) {
	select {
	case r.reports <- rep:
	case <-r.gone:
	}
}

// halted reports whether the runner stopped taking jobs (a rewind, a
// drain, a stale refusal) or its lease is gone: a job's goroutine then
// starts no further attempt.
func (r *runner) halted(halt <-chan struct{}) bool {
	select {
	case <-halt:
		return true
	case <-r.ctx.Done():
		return true
	default:
		return false
	}
}

// attempts runs the attempts of job j until it succeeds or is
// dead-lettered, or the runner stops it, starting from its state st; halt
// is closed when the runner stops taking jobs.
func (r *runner) attempts(j *jobRun, st retryState, halt <-chan struct{}) {
	seq := j.seq
	for !st.dead {
		st.runs++
		job := r.newJob(j.m, j.md, st.runs)
		job.wire = r.wire.Add(1)
		ctx := context.WithValue(r.ctx, jobKey{}, job)
		ctx = r.w.tel.Propagator.Extract(ctx, telemetry.HeaderCarrier(job.Header))
		ctx, span := r.startProcess(ctx, job)
		ctx, cancel := context.WithTimeoutCause(ctx, r.timeout(job), ErrHandleTimeout)
		ctx, cc := r.cancels.attach(ctx, job) // cancel.go
		r.event(ctx, Event{Kind: EventJobStarted, Job: job, Seq: seq, Attempt: st.runs})
		start := time.Now()
		dog := r.watch(ctx, j, job, st, start)
		// An unreadable origin, or a roll-up that purged jobs before it:
		// whatever the handler, say so.
		err := beforeHandle(job)
		ran := err == nil && !r.cancels.has(job)
		if ran {
			err = call(ctx, r.w.handler, job)
		}
		took := time.Since(start)
		hung := dog.done()
		err = attemptError(ctx, err)
		cancel()
		r.cancels.detach(job, cc)
		if hung {
			// Given up on, and reported by the watchdog: the partition is
			// released.
			r.measure(ctx, span, took, err)
			return
		}
		_, effErr := job.close()
		if r.ctx.Err() != nil {
			// The lease is gone (or the drain ran out of time): the job is
			// not done, whatever the handler returned, and its held
			// effects never leave.
			r.measure(ctx, span, took, cmpErr(err, effErr))
			r.tell(report{run: j, kind: reportEnded, st: st})
			return
		}
		if empty, ok, cerr := r.cancelled(j, job, st, ran); ok {
			job, err, effErr = empty, cerr, nil
		}
		if err == nil {
			err = effErr
		}
		if err == nil {
			rep := report{run: j, kind: reportSucceeded, st: st, job: job, ctx: ctx, span: span, took: took, reply: replies.Get().(chan error)}
			r.tell(rep)
			select {
			case err = <-rep.reply:
				// The runner answers once: the channel is empty and
				// no longer the runner's.
				replies.Put(rep.reply)
			case <-r.gone:
				return
			}
			if err == nil {
				return // completed: the runner accounted for it
			}
			if errors.Is(err, ErrJobCancelled) {
				// Cancelled before its finals: the next attempt settles it.
				r.measure(ctx, span, took, err)
				r.abort(job, job.sentSubjects())
				continue
			}
			if errors.Is(err, errHalted) {
				r.measure(ctx, span, took, err)
				r.abort(job, job.sentSubjects())
				r.tell(report{run: j, kind: reportEnded, st: st})
				return
			}
		}
		r.measure(ctx, span, took, err)
		r.abort(job, job.sentSubjects())
		if errors.Is(err, leasehold.ErrStaleEpoch) || errors.Is(err, leasehold.ErrLeaseLost) {
			r.event(ctx, Event{Kind: EventJobFailed, Job: job, Seq: seq, Attempt: st.runs, Err: err, Duration: took})
			r.log.Error("a sink refused this worker's epoch: another worker has taken the partition over; stopping it", "seq", seq, "err", err)
			r.tell(report{run: j, kind: reportStale, st: st})
			return
		}
		v := r.judge(&st, job, err)
		wait := v.wait
		r.event(ctx, v.event(job, seq, st, took))
		if !st.dead {
			v.log(r.log, seq, st.runs, err)
			if r.sleep(wait, halt) != 0 {
				r.tell(report{run: j, kind: reportEnded, st: st})
				return
			}
		}
	}
	if r.halted(halt) && !r.isDraining() {
		// A rewind or a refusal: the job is run again, or by a successor,
		// and dead-lettered then.
		r.tell(report{run: j, kind: reportEnded, st: st})
		return
	}
	if st.dlqNonce == "" {
		st.dlqNonce = newNonce()
	}
	futs, out := r.deadLetter(j.m, j.md, st, halt)
	if out != 0 {
		r.tell(report{run: j, kind: reportEnded, st: st})
		return
	}
	r.tell(report{run: j, kind: reportDeadLettered, st: st, futs: futs})
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// isDraining reports whether a drain was asked for.
func (r *runner) isDraining() bool {
	select {
	case <-r.draining:
		return true
	default:
		return false
	}
}

// onReport handles a report of a job's goroutine in the runner's; a
// non-zero outcome stops the round.
func (r *runner) onReport(rep report) outcome {
	j := rep.run
	if rep.kind == reportSucceeded {
		err := r.finish(rep)
		rep.reply <- err
		if err != nil {
			return 0 // its goroutine carries on, and reports again
		}
		r.ended(j)
		return 0
	}
	r.ended(j)
	switch rep.kind {
	case reportDeadLettered:
		if r.stopping == 0 || r.stopping == outDrain {
			// Kept until its dead letter is acknowledged: a replay sends
			// the same one again, without running its handler.
			r.retries[j.seq] = rep.st
			r.complete(j, rep.st.runs, rep.futs, nil)
			return 0
		}
	case reportStale:
		r.retries[j.seq] = rep.st
		return outStale
	case reportHung:
		return outLost
	}
	r.retries[j.seq] = rep.st
	return 0
}

// finish sends the finals of a job whose handler succeeded, and completes
// it; an error fails the attempt (errHalted: the runner no longer takes
// it).
func (r *runner) finish(rep report) error {
	j, job, st := rep.run, rep.job, rep.st
	if r.stopping != 0 && r.stopping != outDrain || r.ctx.Err() != nil {
		return errHalted
	}
	if r.cancels.late(job) {
		return ErrJobCancelled
	}
	futs, undo, err := job.finish(rep.ctx, r.after, r.policy.floored(), r.watermark)
	if err != nil {
		for i := len(undo) - 1; i >= 0; i-- {
			r.after[undo[i].subject] = undo[i].prev
		}
		return err
	}
	r.measure(rep.ctx, rep.span, rep.took, nil)
	// The job's failure count stays until its effects are acknowledged:
	// an effect can still fail it.
	r.retries[j.seq] = st
	r.complete(j, st.runs, futs, undo)
	r.event(rep.ctx, Event{Kind: EventJobFinished, Job: job, Seq: j.seq, Attempt: st.runs, Duration: rep.took})
	return nil
}

// ended accounts for a job whose goroutine is done: its lane may run its
// next job, and its slot is free.
func (r *runner) ended(j *jobRun) {
	if j.phase == phaseRunning {
		j.phase = phaseQueued // until completed, or run again after a rewind
	}
	if j.laned {
		r.lanes.returned(j)
		j.laned = false
	}
	switch j.slot {
	case slotOwn:
		r.ownBusy = false
	case slotPool:
		r.w.pool.give()
	}
	j.slot = slotNone
	r.live--
	r.w.tel.Metrics.JobsInFlight.Add(r.detachedCtx(), -1)
}

// detachedCtx is r.ctx without its cancellation, for what is recorded
// after the lease is gone: made once, where each job's end made one. The
// runner's goroutine alone calls it.
func (r *runner) detachedCtx() context.Context {
	if r.detached == nil {
		r.detached = context.WithoutCancel(r.ctx)
	}
	return r.detached
}
