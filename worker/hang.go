package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/leasehold/leasehold"
)

// A partition's lease is renewed whatever its handlers do: without a bound on handling, a handler stuck in a
// deadlock or an endless call would hold its partition for good. So, as
// Kafka's max.poll.interval.ms bounds the time between two polls, an
// attempt is bounded by Config.HandleTimeout: past it the handler's
// context is cancelled, with a cause matching ErrHandleTimeout, and the
// attempt counts as failed (towards MaxAttempts, then the dead-letter
// stream) whatever it returns. A handler that has not returned HangGrace
// after its context was cancelled — by the timeout, a lost lease or a drain
// that ran out of time — has hung: the worker logs it, counts it
// (leasehold_jobs_hung_total), reports EventJobHung, refuses the job's
// further emits, and gives the partition up: it stops renewing and
// releases the lease, so that another worker can take the partition: the
// whole partition, with the jobs that ran beside the hung one, whose
// handlers are cancelled (the lease's context ends) and which the next
// holder runs again. What the hung handler still writes carries an epoch
// the sinks then refuse. Its goroutine cannot be stopped; the worker stops
// waiting for it.
//
// The failed attempt is remembered by the worker: should it take the
// partition again, the job resumes its count of failures, so a job that
// hangs every time is dead-lettered after MaxAttempts hangs instead of
// holding the partition in turns. A job re-run by another worker starts
// its count again, as after any fail-over.

// ErrHandleTimeout is matched by the cause of a handler context that ran
// past Config.HandleTimeout, and by the error of such an attempt.
var ErrHandleTimeout = errors.New("worker: the handler ran past HandleTimeout")

// ErrHandlerHung is matched by the cause of a partition runner's context
// after its handler hung, and by the error dead-lettered for the job.
var ErrHandlerHung = errors.New("worker: the handler did not return after its context was cancelled")

// hangRecord is a job whose handler hung, as the worker remembers it.
type hangRecord struct {
	seq      uint64
	failures int
	err      error
}

// watchdog watches one attempt: once the handler's context is done, the
// handler has HangGrace to return.
type watchdog struct {
	stopCtx func() bool
	mu      sync.Mutex
	timer   *time.Timer
	over    bool // the handler returned
	hung    bool
}

// watch arms the watchdog of the attempt of run j running job under ctx;
// st is the job's state before the attempt. Should the handler hang, the
// partition is given up and the runner told.
func (r *runner) watch(ctx context.Context, j *jobRun, job *Job, st retryState, start time.Time) *watchdog {
	d := &job.dog // one allocation less per attempt: the job's lives as long
	d.stopCtx = context.AfterFunc(ctx, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.over {
			return
		}
		d.timer = time.AfterFunc(r.w.cfg.HangGrace, func() {
			d.mu.Lock()
			if d.over {
				d.mu.Unlock()
				return
			}
			d.hung = true
			d.mu.Unlock()
			r.abandon(job, st, start, context.Cause(ctx))
			r.tell(report{run: j, kind: reportHung, st: st})
		})
	})
	return d
}

// done disarms the watchdog once the handler has returned and reports
// whether the handler had been given up on.
func (d *watchdog) done() (hung bool) {
	d.stopCtx()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.over = true
	if d.timer != nil {
		d.timer.Stop()
	}
	return d.hung
}

// attemptError is the error of an attempt that ran past HandleTimeout:
// it failed, whatever the handler returned.
func attemptError(ctx context.Context, err error) error {
	cause := context.Cause(ctx)
	if !errors.Is(cause, ErrHandleTimeout) {
		return err
	}
	if err == nil || errors.Is(err, context.DeadlineExceeded) {
		return cause
	}
	return fmt.Errorf("%w (the handler returned: %w)", cause, err)
}

// abandon gives the partition up after a handler hung. It runs on the
// watchdog's goroutine while the job's is stuck in the handler.
func (r *runner) abandon(job *Job, st retryState, start time.Time, cause error) {
	r.abandonOnce.Do(func() { r.giveUp(job, st, start, cause) })
}

func (r *runner) giveUp(job *Job, st retryState, start time.Time, cause error) {
	err := fmt.Errorf("%w: job %d of partition %d, attempt %d, running for %v (its context ended: %v)",
		ErrHandlerHung, job.Seq, r.p, st.runs, time.Since(start).Round(time.Millisecond), cause)
	r.w.rememberHang(r.p, hangRecord{seq: job.Seq, failures: st.failures + 1, err: err})
	r.log.Warn("handler hung: it did not return after its context was cancelled; giving the partition up so that another worker can take it",
		"seq", job.Seq, "attempt", st.runs, "running", time.Since(start).Round(time.Millisecond), "grace", r.w.cfg.HangGrace, "cause", cause)
	ctx := context.WithoutCancel(r.ctx)
	r.w.tel.Metrics.JobsHung.Add(ctx, 1, r.w.tel.Metrics.PartitionAttrs(r.info.Holder, r.p))
	r.event(ctx, Event{Kind: EventJobHung, Job: job, Seq: job.Seq, Attempt: st.runs, Duration: time.Since(start), Err: err})
	_, _ = job.close() // its later emits are refused
	r.cancel(err)
	r.untrack()
	close(r.abandoned)
	// Release bounds its own requests; this bounds its retries.
	rctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := r.lease.Release(rctx); err != nil && !errors.Is(err, leasehold.ErrLeaseLost) {
		r.log.Warn("releasing the partition of a hung handler failed; it expires within the TTL", "err", err)
	}
}

// untrack tells Run not to wait for this runner's goroutine: it ends
// normally, or its handler hung and it is abandoned.
func (r *runner) untrack() { r.untrackOnce.Do(r.w.tasks.Done) }

// rememberHang records that a job of partition p hung here.
func (w *Worker) rememberHang(p leasehold.Partition, h hangRecord) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.hangs == nil {
		w.hangs = map[leasehold.Partition]hangRecord{}
	}
	w.hangs[p] = h
}

// recallHang returns the failures of a job of partition p after progress
// that hung here before, for a new runner to resume its count.
func (w *Worker) recallHang(p leasehold.Partition, progress uint64) (hangRecord, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	h, ok := w.hangs[p]
	if ok && h.seq <= progress {
		delete(w.hangs, p) // settled since
		return hangRecord{}, false
	}
	return h, ok
}
