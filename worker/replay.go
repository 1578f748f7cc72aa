package worker

// A rewind runs again the jobs whose finals this lease sent and that are
// not done (the window), and a sink may hold the first run's finals of
// any of them: one that was not acknowledged may be stored all the same.
// A stream sink applies a job from the first of its attempts, in the
// order they appear in the log, that is complete and whose final's After
// holds; so should a job's first complete attempt name in After a job
// whose only complete attempt names it back, the sink waits on both for
// good, and the jobs are committed. Run side by side again, the jobs
// could complete in another order than the first time and name each
// other so.
//
// So the jobs of the window are replayed: run again in the order they
// completed, one at a time, each once the one before completed again (its
// finals sent, or its dead letter stored), before any other job of the
// partition starts; then the partition runs its jobs side by side again.
// The after map was unwound to what it was before the first of them sent
// its finals, and nothing else completes meanwhile, so each job's finals
// name on each subject what its first finals in this lease named, for a
// handler that emits on the same subjects when it runs again (as one must
// for its idempotency keys to mean anything). Every final of a job in a
// lease then names the same After, whichever attempt a sink applies it
// from, and that job completed before it: the jobs a lease's finals name
// form no cycle. Done still follows completion order, the order in which
// first finals were sent, so a job is committed only once the job its
// finals name is finished.
//
// The cases around it:
//   - A second rewind during a replay puts the jobs replayed and not done
//     back at the head, before those still to replay: the order is the
//     first one's.
//   - A job that the replay does not complete with finals (it fails for
//     good and is dead-lettered, or it is cancelled) changes nothing in
//     the after map, so the next job's finals name the job its first ones
//     named but one. The sink then applies that next job from its first
//     attempt, if that one is in the log and the job it names applies;
//     otherwise, once the next job is committed, it finds that the named
//     job never applies (streamsink's hopeless rule) and takes the later
//     attempt, whose After holds. No cycle forms: each final still names
//     a job that completed before it.
//   - A dead-lettered job of the window sends the same dead letter again,
//     without running its handler.
//   - A drain, a lost lease or a refusal during a replay ends the round as
//     ever: the jobs not replayed are not committed, and the successor's
//     barrier settles what the lease sent.
//   - The jobs run from the messages they were first read from, so a
//     replay does not wait for the fetcher; reading one again tracks it.
//   - Every order (key, partition, none) replays so. In a lane, the order
//     jobs complete in is stream order, and no job before one of the
//     window in its lane is not done or in the window, so key order holds.

// requeue puts the jobs of a window, in the order they completed, at the
// head of the jobs to replay.
func (r *runner) requeue(window []*jobRun) {
	if len(window) == 0 {
		return
	}
	for _, j := range window {
		j.phase, j.futs, j.acked, j.undo, j.slot = phaseQueued, nil, 0, nil, slotNone
	}
	r.replay = append(window, r.replay...)
}

// trackReplay starts a round's view of the jobs to replay: none of them
// is tracked yet.
func (r *runner) trackReplay() {
	clear(r.untracked)
	if len(r.replay) == 0 {
		return
	}
	if r.untracked == nil {
		r.untracked = make(map[uint64]*jobRun, len(r.replay))
	}
	for _, j := range r.replay {
		r.untracked[j.seq] = j
	}
}

// dispatchReplay starts the first job to replay once no job of the
// partition runs and the window has room.
func (r *runner) dispatchReplay() {
	if r.stopping != 0 || r.live > 0 || len(r.window) >= r.w.cfg.MaxInFlight {
		return
	}
	j := r.replay[0]
	if j.phase != phaseQueued {
		return
	}
	// Nothing runs, so the partition's own slot is free.
	j.slot, r.ownBusy = slotOwn, true
	r.startJob(j)
}

// replayed takes j off the jobs to replay once it completed again.
func (r *runner) replayed(j *jobRun) {
	for i, x := range r.replay {
		if x == j {
			n := len(r.replay) - 1
			copy(r.replay[i:], r.replay[i+1:])
			r.replay[n] = nil
			r.replay = r.replay[:n]
			return
		}
	}
}
