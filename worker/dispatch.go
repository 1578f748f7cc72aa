package worker

import (
	"errors"
	"slices"
	"time"

	"github.com/leasehold/leasehold"
)

// The runner's goroutine dispatches: it reads the partition's jobs into
// their lanes, starts the jobs that may start (lanes.go) while the
// partition has room (Config.PartitionConcurrency, and a slot: slots.go),
// takes the reports of the jobs' goroutines (attempts.go), sends their
// finals, follows the acknowledgements of their effects, moves the
// watermark and commits (progress.go). It alone touches this state.
//
// A round reads the partition from the job after the watermark, skipping
// the jobs done beyond it, and ends on a drain, a lost lease, a stale
// refusal or a failed effect. It then stops taking jobs, lets the running
// ones end, and reports why: a drain completes what succeeds meanwhile; a
// rewind, a refusal or a loss completes nothing more.

// consume runs one round.
func (r *runner) consume() outcome {
	r.begin()
	r.fetch = r.startFetch(r.watermark + 1)
	defer func() {
		r.fetch.stop()
		r.fetch = nil
	}()
	tick := time.NewTicker(r.tickEvery())
	defer tick.Stop()
	// soon commits a partition that caught up, a moment after the last
	// commit (see caughtUp).
	soon := time.NewTimer(time.Hour)
	soon.Stop()
	defer soon.Stop()
	var soonC <-chan time.Time
	for {
		select {
		case <-r.ctx.Done():
			return r.stop(outLost)
		case <-r.draining:
			return r.stop(outDrain)
		default:
		}
		var jobs <-chan *jobMsg
		if len(r.track) < r.span {
			jobs = r.fetch.out
		}
		ok, failed := r.head()
		var out outcome
		select {
		case <-r.ctx.Done():
			out = outLost
		case <-r.draining:
			out = outDrain
		case rep := <-r.reports:
			out = r.onReport(rep)
		case m := <-jobs:
			r.admit(m)
		case ack := <-ok:
			if seq, err := r.acked(ack, nil); err != nil {
				out = r.failed(seq, err)
			}
		case err := <-failed:
			if seq, err := r.acked(nil, err); err != nil {
				out = r.failed(seq, err)
			}
		case <-r.wake:
			r.spare++
		case <-tick.C:
			r.w.tel.Metrics.SetLag(r.info.Holder, r.p, r.pending)
			out = r.progress()
		case <-soonC:
			soonC = nil
			if r.caughtUp() {
				out = r.commitNow()
			}
		}
		if out == 0 && len(r.window) > 0 {
			if seq, err := r.reap(r.ctx, false); err != nil {
				out = r.failed(seq, err)
			}
		}
		if out != 0 {
			return r.stop(out)
		}
		r.dispatch()
		if soonC == nil && r.caughtUp() {
			if wait := r.commitGap() - time.Since(r.lastCommit); wait > 0 {
				soon.Reset(wait)
				soonC = soon.C
			} else if out = r.commitNow(); out != 0 {
				return r.stop(out)
			}
		}
	}
}

// caughtUp reports whether the partition has done all it read, and has
// progress to commit: no job runs, waits or awaits its effects, the
// fetcher holds no job, and the last commit did not fail. It then commits
// at once, at most once every commitGap, rather than at the next
// CommitEvery: a burst's last jobs show as done (Producer.Wait, status)
// without waiting for the tick, and a partition that takes a job now and
// then commits each one soon after it is done.
func (r *runner) caughtUp() bool {
	if r.live > 0 || len(r.window) > 0 || r.lanes.queued > 0 || len(r.replay) > 0 || len(r.fetch.out) > 0 || r.commitFailed {
		return false
	}
	return r.watermark > r.committed || r.watermark == r.committed && !slices.Equal(r.doneSet, r.committedDone)
}

// commitGap is the least time between two commits of a partition that
// caught up: a fifth of CommitEvery, at most 50 ms.
func (r *runner) commitGap() time.Duration {
	return max(min(r.w.cfg.CommitEvery/5, 50*time.Millisecond), time.Millisecond)
}

// commitNow commits; a refused commit ends the round.
func (r *runner) commitNow() outcome {
	if err := r.commit(r.ctx); errors.Is(err, leasehold.ErrLeaseLost) {
		return outLost
	}
	return 0
}

// tickEvery is how often the runner looks at its progress when nothing
// else happens: to commit, and to find effects unacknowledged past
// EffectTimeout.
func (r *runner) tickEvery() time.Duration {
	return max(min(r.w.cfg.CommitEvery, r.w.cfg.EffectTimeout/4), 10*time.Millisecond)
}

// begin starts a round from the watermark.
func (r *runner) begin() {
	for i := range r.track {
		r.track[i] = nil
	}
	r.track, r.window = r.track[:0], nil
	r.lanes = newLanes()
	r.trackReplay()
	r.fetched = r.watermark
	r.halt, r.stopping = make(chan struct{}), 0
}

// admit takes a job the fetcher read.
func (r *runner) admit(m *jobMsg) {
	md := &m.md
	seq := md.Sequence.Stream
	if seq <= r.fetched {
		return
	}
	r.fetched = seq
	r.pending = md.NumPending
	if j := r.untracked[seq]; j != nil {
		// A job to replay: it runs from the message it was first read
		// from, and is tracked from here on.
		delete(r.untracked, seq)
		r.track = append(r.track, j)
		if j.phase == phaseDone {
			r.advance()
		}
		return
	}
	j := &jobRun{seq: seq}
	r.track = append(r.track, j)
	if r.isDone(seq) {
		// Done before: in this lease before a rewind, or by the lease the
		// progress was committed under.
		j.phase = phaseDone
		r.advance()
		return
	}
	j.m, j.md = m, md
	j.lane = r.laneOf(seq, m.Headers())
	r.lanes.push(j)
}

// badOrderKey reports a job whose order key does not parse, once a
// runner: it is ordered by partition.
func (r *runner) badOrderKey(err error) {
	if r.badKeys++; r.badKeys == 1 {
		r.log.Warn("a job's order key does not parse: it runs ordered by partition (this is said once a lease)", "err", err)
	}
}

// dispatch starts the jobs that may start now: while jobs wait to be
// replayed, only the first of them (replay.go).
func (r *runner) dispatch() {
	if len(r.replay) > 0 {
		r.dispatchReplay()
	}
	for len(r.replay) == 0 && r.stopping == 0 && r.lanes.running < r.policy.concurrency && r.lanes.running+len(r.window) < r.w.cfg.MaxInFlight {
		j := r.lanes.next()
		if j == nil {
			break
		}
		slot := slotOwn
		if r.ownBusy {
			if !r.takeSlot() {
				break
			}
			slot = slotPool
		}
		r.lanes.start(j)
		j.laned = true
		if slot == slotOwn {
			r.ownBusy = true
		}
		j.slot = slot
		r.startJob(j)
	}
	for ; r.spare > 0; r.spare-- {
		r.w.pool.give()
	}
}

// takeSlot takes a slot of the worker's pool: one handed over, or a free
// one. When none is free, the pool hands the next one given back over
// through r.wake.
func (r *runner) takeSlot() bool {
	if r.spare > 0 {
		r.spare--
		return true
	}
	select {
	case <-r.wake:
		return true
	default:
	}
	return r.w.pool.take(r.wake)
}

// stop ends the round: no job starts any more, and those running end (the
// jobs' goroutines start no further attempt). It waits for them, handling
// their reports: on a drain, what succeeds meanwhile is completed. It
// returns why the round ended: a refusal or a loss seen meanwhile wins over
// a drain or a rewind.
func (r *runner) stop(out outcome) outcome {
	r.stopping = out
	close(r.halt)
	r.fetch.stop()
	for r.live > 0 {
		select {
		case rep := <-r.reports:
			switch got := r.onReport(rep); {
			case got == outLost:
				r.stopping = outLost
			case got == outStale && r.stopping != outLost:
				r.stopping = outStale
			}
		case <-r.wake:
			r.w.pool.give()
		}
	}
	for ; r.spare > 0; r.spare-- {
		r.w.pool.give()
	}
	if r.stopping == outRewind && r.ctx.Err() != nil {
		r.stopping = outLost
	}
	return r.stopping
}
