package worker

import (
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// A handler that cannot do its work yet (a rate limit, a resource not
// ready, a batch still filling) returns Snooze(d): the job runs again
// after d, and the attempt does not count towards its attempts. The job
// waits in place, as it waits out a backoff: it keeps its order (the jobs
// after it of its order key, or of its partition when it is ordered by
// partition, wait for it), its slot, and the partition's progress stays
// below it. The attempt is otherwise a failed one: what it emitted never
// leaves (its held effects are dropped, and an abort marker closes what
// left), and its span and the job metrics count it as failed.
//
// Snoozes are bounded: past Config.MaxSnoozes (or the kind's MaxSnoozes)
// a snooze counts as a failed attempt with an error matching
// ErrSnoozeLimit, retried with backoff and dead-lettered as any failure
// is; each snooze is an EventJobSnoozed (Backoff: the wait), each one past
// the bound an EventJobFailed. The count is the runner's: a job that moves
// to another worker, or is read again after a rewind that drops it,
// starts it again, as it does its attempts.
//
// Snooze for seconds or minutes: a job snoozing holds up the jobs ordered
// after it, and a partition whose progress does not move for StallAfter
// is reported stalled. For a job that should run hours later, enqueue a
// delayed job (EnqueueAt) and return nil.

// SnoozeError is the error Snooze returns.
type SnoozeError struct {
	Wait time.Duration // how long the job waits before it runs again
}

func (e *SnoozeError) Error() string {
	return fmt.Sprintf("worker: the handler snoozed the job for %v", e.Wait)
}

// Snooze returns an error that, returned by a handler (wrapped or not),
// runs the job again after d without counting an attempt. A negative d is
// 0. Wrapped in Permanent, or returned after the attempt's timeout, it is
// that failure instead.
func Snooze(d time.Duration) error { return &SnoozeError{Wait: max(d, 0)} }

// ErrSnoozeLimit is matched by the error of an attempt that snoozed past
// Config.MaxSnoozes (or its kind's MaxSnoozes): it counts as failed.
var ErrSnoozeLimit = errors.New("worker: the job snoozed more times than it may")

// MaxSnoozes sets how many times a job of the kind may snooze before a
// snooze counts as a failed attempt, instead of Config.MaxSnoozes. It
// panics on n < 0.
func MaxSnoozes(n int) KindOption {
	if n < 0 {
		panic(fmt.Sprintf("worker: MaxSnoozes(%d): use 0 or more", n))
	}
	return func(o *kindOptions) { o.maxSnoozes, o.snoozesSet = n, true }
}

// snoozeOf reports the wait a handler's error err asks for, if it is a
// snooze: not one wrapped in Permanent, nor one after the timeout.
func snoozeOf(err error) (time.Duration, bool) {
	var s *SnoozeError
	if !errors.As(err, &s) || IsPermanent(err) || errors.Is(err, ErrHandleTimeout) {
		return 0, false
	}
	return s.Wait, true
}

// maxSnoozes is how many times job may snooze.
func (r *runner) maxSnoozes(job *Job) int {
	if o, ok := r.w.kindOptions(job.Header); ok && o.snoozesSet {
		return o.maxSnoozes
	}
	return r.w.cfg.MaxSnoozes
}

// snooze judges a snoozing attempt: within the bound it waits d and counts
// nothing; past it, it returns the failure it counts as.
func (r *runner) snooze(st *retryState, job *Job, d time.Duration) (verdict, error) {
	st.snoozes++
	limit := r.maxSnoozes(job)
	if st.snoozes <= limit {
		return verdict{snoozed: true, wait: d}, nil
	}
	return verdict{}, fmt.Errorf("%w: job %d of partition %d snoozed %d times, and %d are allowed (Config.MaxSnoozes, or its kind's MaxSnoozes)",
		ErrSnoozeLimit, job.Seq, job.Partition, st.snoozes, limit)
}

// log says what becomes of a job that is not dead-lettered after an
// attempt: it is retried after a backoff, or it snoozes.
func (v verdict) log(log *slog.Logger, seq uint64, attempt int, err error) {
	if v.snoozed {
		log.Debug("job snoozed", "seq", seq, "attempt", attempt, "wait", v.wait)
		return
	}
	log.Warn("job failed; retrying", "seq", seq, "attempt", attempt, "backoff", v.wait, "err", err)
}
