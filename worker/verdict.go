package worker

import "time"

// verdict is what becomes of a job after a failed attempt: whether the
// failure counts towards its attempts, and the wait before the next one
// (the job's retry state says whether there is one).
type verdict struct {
	counted bool
	snoozed bool // the handler snoozed the job (snooze.go): wait is the snooze
	wait    time.Duration
}

// judge accounts for the failed attempt err of job, whose state st it
// updates: a snooze within its bound waits and counts nothing (snooze.go);
// a failure that counts uses up an attempt, and a permanent one,
// or the last attempt's, marks the job to be dead-lettered; its kind's
// options (kindopts.go) say how many attempts it has and how long it
// waits between them. The worker's
// runner and InMemory both judge through it.
func (r *runner) judge(st *retryState, job *Job, err error) verdict {
	if d, ok := snoozeOf(err); ok {
		v, failure := r.snooze(st, job, d)
		if failure == nil {
			return v
		}
		err = failure
	}
	var v verdict
	if r.counts(st, err) {
		st.failures++
		v.counted = true
	}
	st.err = err
	st.dead = IsPermanent(err) || st.failures >= r.maxAttempts(job)
	if !st.dead {
		v.wait = r.backoff(job, st.runs)
	}
	return v
}

// event is the event of the failed attempt v judged: snoozed, or failed.
func (v verdict) event(job *Job, seq uint64, st retryState, took time.Duration) Event {
	if v.snoozed {
		return Event{Kind: EventJobSnoozed, Job: job, Seq: seq, Attempt: st.runs, Duration: took, Backoff: v.wait}
	}
	return Event{Kind: EventJobFailed, Job: job, Seq: seq, Attempt: st.runs, Err: st.err, Duration: took, Backoff: v.wait}
}
