package streamsink

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// A job's effects apply all or none. Effects a worker publishes for a job
// carry the job and the attempt (leasehold.JobMark); the attempt's last
// effect on a subject, its final, counts the attempt's effects there and
// names the job that completed before it on the subject in the same lease.
// The runner holds the effects of a job back, by group (fence, subject,
// epoch, acquisition, job) and within it by attempt (attempts.go), and
// applies one attempt of a group, all its effects in one call of the
// handler or one republish round, once it holds the attempt's final and
// every effect it counts, and the job its final names is settled on the
// fence and subject in that lease (chains.go).
// The job's other attempts are then dropped, reported sink.Aborted, and so
// is an attempt proven never to complete (proofs.go): effects of an
// attempt that did not complete are never applied.
//
// A job counts as applied once its effects were delivered. Where each
// fence and subject stands in a lease (its floor and the jobs applied above
// it: chains.go) is what later jobs' finals are judged against (their
// After), and what takes a job's effects coming again for duplicates; a
// job whose delivery went to the dead-letter stream is remembered beside it
// (applied.Holes), so that its dead letters, replayed, apply on their own
// instead.
//
// The saved position never passes the first log position of a group still
// open: a runner that restarts reads the log again from there and finds
// the open groups again. Where each fence and subject stands is saved
// beside the position (applied.go), so that reading again applies no job
// twice. Effects that carry no job apply on their own, as they always did.

// ErrGroupLimit is matched by the error of a runner that holds as many
// effects of open jobs as Config.MaxHeldEffects allows, or their data takes
// Config.MaxHeldBytes: it stops there, and Ready says so, until the limit is
// raised. Jobs whose effects never complete (a worker that dies and whose
// partition nobody takes over) are the likely cause.
var ErrGroupLimit = errors.New("streamsink: open job effects limit reached")

// groupKey names one job's effects on one subject under one lease.
type groupKey struct {
	chainKey
	epoch       leasehold.Epoch
	acquisition string
	job         uint64
}

// A few emptied lanes are kept for the next groups, so that a job of a
// few effects costs no lane of its own.
const (
	maxSpareLanes = 64
	maxSpareJobs  = 64
)

// groups is the runner's open job groups and what it applied, as of the
// position it has decided.
type groups struct {
	open    map[groupKey]*group
	lanes   map[laneKey]*lane // the open groups' jobs, by chain and lease
	spare   []*lane           // lanes emptied, for reuse
	busy    map[chainKey]int  // open groups by chain
	applied map[chainKey]applied
	delta   map[chainKey]applied // applied since the shards were written: saved in the position record
	dirty   map[int]bool         // applied shards being written
	held    int                  // effects held in open groups
	bytes   int                  // their data and headers (heldSize)
	above   int                  // jobs the chains hold applied above their floors
	crowded bool                 // a chain holds many of them: the records are read soon (proofs.go)
	forgot  int                  // jobs the chains forgot at their bound since the last batch saved
	// overflow is the error of a chain that holds more jobs above its
	// floor than maxAbove: the batch is not delivered (see settle).
	overflow error
}

func newGroups() *groups {
	return &groups{open: map[groupKey]*group{}, lanes: map[laneKey]*lane{}, busy: map[chainKey]int{},
		applied: map[chainKey]applied{}, delta: map[chainKey]applied{}, dirty: map[int]bool{}}
}

// firstOpen returns the first log position of an open group's effects,
// or 0.
func (gs *groups) firstOpen() uint64 {
	var first uint64
	for _, g := range gs.open {
		if g.first != 0 && (first == 0 || g.first < first) {
			first = g.first
		}
	}
	return first
}

// heldCopy is the outcome of o held, or handed on, for delivery as an
// effect of job: it is reported when its group is settled.
func heldCopy(o *outcome, job uint64) outcome {
	held := sharedCopy(o, job)
	held.m = &logMsg{seq: o.m.seq, subject: o.m.subject, header: o.m.header, data: o.m.data}
	return held
}

// sharedCopy is heldCopy for an outcome whose message is no delivery of
// the consumer (its msg is nil, as for a packed message's effects but
// its last), which the copy shares: acking goes by the msg, and a copy
// without one is acked never, as heldCopy's.
func sharedCopy(o *outcome, job uint64) outcome {
	held := *o
	held.deliver, held.report, held.term, held.job = true, true, false, job
	return held
}

// setAside reports the message of o as not applied, set aside as
// suspicious for reason.
func setAside(o *outcome, reason string, err error) {
	o.deliver, o.report = false, true
	o.d.Outcome, o.d.Suspect, o.d.Err = sink.Aborted, reason, err
}

// decideJob places an admitted effect of a job. o is the effect's own
// outcome, decided for the batch it came in: it is acknowledged then, and
// what becomes of it is reported when its group is applied or dropped,
// appended to outs.
func (r *Runner) decideJob(o *outcome, mark leasehold.JobMark, outs *[]outcome) error {
	gs := r.groups
	st := o.d.Stamp
	chain := chainKey{fence: st.Fence(), subject: o.m.subject}
	k := groupKey{chainKey: chain, epoch: st.Epoch, acquisition: st.Acquisition, job: mark.Job}
	o.deliver, o.report = false, false
	a := gs.chain(k)
	if a.done(mark.Job) {
		switch {
		case mark.Abort:
		case a.hole(mark.Job):
			// Its delivery went to the dead-letter stream: this is a
			// replay, and applies on its own.
			o.deliver, o.report, o.job = true, true, mark.Job
		case otherKeys(o.m.header, st, mark.Job, a):
			// The job was applied under the other set of its keys (its
			// own, or its origin's): one of the two attempts is not the
			// worker's, and which one the runner cannot tell. Dropped as
			// a duplicate, the worker's could be lost under a forged one
			// whose keys a destination that dedupes took long ago; on
			// its own, each key is applied once there.
			o.deliver, o.report, o.job = true, true, mark.Job
		default:
			// Applied already (a replay, or a re-run of an applied job).
			o.report = true
			o.d.Outcome = sink.Duplicate
		}
		return nil
	}
	if !mark.Abort && !keyNamesJob(st, mark.Job) && !keyNamesOrigin(o.m.header, st, mark.Job) {
		setAside(o, SuspectJobKey, fmt.Errorf("streamsink: the effect at log position %d names job %d, and its key %q another: a worker's keys name their job", o.m.seq, mark.Job, st.Key))
		return nil
	}
	// Most jobs' chains hold no open group: their effect is applied alone.
	busy := gs.busy[chain] != 0
	var g *group
	var at *attempt
	if busy {
		if g = gs.open[k]; g != nil {
			at = g.find(mark.Attempt)
		}
	}
	if at == nil && r.afterCommit(k, o.m.seq) {
		if !mark.Abort {
			setAside(o, SuspectAfterCommit, fmt.Errorf("streamsink: attempt %d of job %d at log position %d came after the fence record showed that its lease commits no more of the job", mark.Attempt, mark.Job, o.m.seq))
		}
		return nil
	}
	if !busy && r.applyAlone(o, k, mark, a, outs) {
		return nil
	}
	if mark.Abort {
		r.onAbort(o, k, g, at, mark, outs)
		return nil
	}
	if g == nil {
		g = &group{}
		if r.proofs != nil {
			g.born = r.proofs.round
		}
	}
	if g.isClosed(mark.Attempt) {
		// Closed by its abort marker (no progress reader: trusted).
		o.report, o.d.Outcome = true, sink.Aborted
		return nil
	}
	if at != nil && at.keys.has(st.Key) {
		// A copy of an effect the attempt holds.
		if mark.Final() && (mark != at.final || st.Key != at.finalKey) {
			reason := SuspectFinalConflict
			if !at.final.Final() || st.Key != at.finalKey {
				reason = SuspectFinalKey
			}
			setAside(o, reason, fmt.Errorf("streamsink: a final of attempt %d of job %d at log position %d repeats key %q the attempt holds", mark.Attempt, mark.Job, o.m.seq, st.Key))
		}
		return nil
	}
	if mark.Final() && at != nil && at.final.Final() {
		setAside(o, SuspectFinalConflict, fmt.Errorf("streamsink: attempt %d of job %d has its final already; a second one at log position %d is not the worker's", mark.Attempt, mark.Job, o.m.seq))
		return nil
	}
	size := heldSize(o.m)
	if gs.held >= r.cfg.MaxHeldEffects || gs.bytes+size > r.cfg.MaxHeldBytes {
		return fmt.Errorf("%w: %d effects (%d bytes) of jobs whose effects are not all in the log are held (Config.MaxHeldEffects %d, MaxHeldBytes %d); at log position %d, job %d of %s on %s: a worker that died mid-job and whose partition nobody took over leaves its job open, and so do effects of one job spread far apart in the log; raise the limits",
			ErrGroupLimit, gs.held, gs.bytes, r.cfg.MaxHeldEffects, r.cfg.MaxHeldBytes, o.m.seq, mark.Job, chain.fence, chain.subject)
	}
	held := heldCopy(o, mark.Job)
	if at == nil {
		if top := g.top(); top > mark.Attempt {
			held.d.Suspect = SuspectAttemptOrder
			held.d.Err = fmt.Errorf("streamsink: attempt %d of job %d first appears at log position %d, after attempt %d: it ranks after it", mark.Attempt, mark.Job, o.m.seq, top)
		}
		at = g.add(mark.Attempt, o.m.seq)
	}
	if mark.Final() {
		at.final, at.finalKey = mark, st.Key
		if at.abort != nil {
			// A worker sends no final after an abort of the same attempt:
			// one of the two is not its own. The attempt is disputed
			// (see candidate).
			ab := *at.abort
			ab.d.Suspect = SuspectAbortBeforeFinal
			ab.d.Err = fmt.Errorf("streamsink: the abort marker at log position %d came before the final of its attempt %d of job %d, at %d: no worker sends both, and the attempt waits for the fence record", ab.m.seq, mark.Attempt, mark.Job, o.m.seq)
			*outs = append(*outs, ab)
			at.abort = nil
			r.proofs.soon = true
		}
	}
	at.keys.add(st.Key)
	at.held = append(at.held, held)
	at.bytes += size
	gs.held++
	gs.bytes += size
	if !at.over && at.complete() && at.keys.len() > at.final.Effects {
		at.over = true
		h := &at.held[len(at.held)-1]
		h.d.Suspect = SuspectOverCount
		h.d.Err = fmt.Errorf("streamsink: attempt %d of job %d holds %d effects, and its final counts %d: one is not the worker's, and all are applied", mark.Attempt, mark.Job, at.keys.len(), at.final.Effects)
	}
	r.keepGroup(k, g)
	r.applyReady(k, outs)
	return nil
}

// onAbort takes an abort marker of attempt at (nil when the runner holds
// none of it) of group k. An abort concerns its own attempt only. With a
// progress reader it is a hint: the attempt waits for proof, and one
// whose final came too is disputed (see candidate). Without one it is
// trusted, and closes the attempt.
func (r *Runner) onAbort(o *outcome, k groupKey, g *group, at *attempt, mark leasehold.JobMark, outs *[]outcome) {
	switch {
	case at == nil:
		if mark.Attempt > r.topAttempt(k) {
			setAside(o, SuspectAbortUnknown, fmt.Errorf("streamsink: the abort marker at log position %d names attempt %d of job %d, above every attempt of its lease on %s: a worker sends one after its attempt's effects", o.m.seq, mark.Attempt, mark.Job, k.subject))
		}
	case !r.proven(k.fence):
		r.dropAttempt(g, at, outs)
		g.close(mark.Attempt)
		r.keepGroup(k, g)
		r.applyReady(k, outs)
	case at.aborted:
	default:
		// The job's next attempt, or the proof that its final is
		// disputed, waits for the fence record: read it soon.
		r.proofs.soon = true
		at.aborted = true
		if !at.final.Final() {
			// Kept to be reported, should the attempt's final come after it.
			ab := *o
			ab.m = &logMsg{seq: o.m.seq, subject: o.m.subject, header: o.m.header}
			ab.deliver, ab.report, ab.term = false, true, false
			ab.d.Outcome = sink.Aborted
			at.abort = &ab
		}
	}
}

// topAttempt is the highest attempt number the runner knows of k's lease
// on k's chain.
func (r *Runner) topAttempt(k groupKey) uint64 {
	gs := r.groups
	top := gs.chain(k).top
	if l := gs.lanes[k.laneKey()]; l != nil {
		for _, job := range l.jobs {
			top = max(top, gs.open[k.withJob(job)].top())
		}
	}
	return top
}

// applyAlone applies at once a job's only effect that comes next on a
// chain with no open group, and reports whether it did: what the group
// would do, placed, completed and applied in one step, without building
// it. That is the effect of nearly every job, so it is worth the shortcut.
// Anything else (more effects, an open group on the chain, the job its
// final names not settled yet, a runner at its held-effects limit) takes the way of
// groups. It is called only for a chain with no open group: no other
// attempt of the job is open, none can rank before this one, and no job
// is open whose fate its floor could decide.
func (r *Runner) applyAlone(o *outcome, k groupKey, mark leasehold.JobMark, a applied, outs *[]outcome) bool {
	gs := r.groups
	if mark.Effects != 1 || mark.Abort || mark.Attempt == 0 || !a.holds(mark.After) ||
		gs.held >= r.cfg.MaxHeldEffects || gs.bytes+heldSize(o.m) > r.cfg.MaxHeldBytes {
		return false
	}
	*outs = append(*outs, heldCopy(o, k.job))
	gs.advance(k, a, mark, mark.Attempt, !keyNamesJob(o.d.Stamp, k.job), !r.proven(k.fence))
	return true
}

// heldSize is what holding m costs towards Config.MaxHeldBytes: its data
// and its headers as written on the wire. The headers count: an effect can
// carry its weight in them (up to the server's max payload, thousands of
// pairs), and a held effect keeps them.
func heldSize(m *logMsg) int { return len(m.data) + headerSize(m.header) }

// resetGroups forgets the open groups: the runner reads the log again from
// its saved position (see Runner.reload).
func (r *Runner) resetGroups() {
	old := r.groups
	r.groups = newGroups()
	r.groups.applied, r.groups.delta, r.groups.dirty, r.groups.above = old.applied, old.delta, old.dirty, old.above
	r.groups.forgot = old.forgot
}

// heldEffects returns how many effects the open groups hold, and how many
// jobs the chains hold above their floors.
func (r *Runner) heldEffects() (int, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.heldCount, r.aboveCount
}

// reload makes the saved state the runner's again, after a batch that
// placed effects in groups could not be saved: the groups are found again
// by reading the log from the saved position.
func (r *Runner) reload(ctx context.Context) error {
	st, err := r.loadState(ctx)
	if err != nil {
		return err
	}
	ap, err := r.loadApplied(ctx)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.seq, r.saved, r.rev, r.fences, r.skips = st.seq, st.seq, st.rev, st.fences, st.skips
	r.adoptApplied(ap, st.delta)
	r.heldCount, r.aboveCount, r.stuckCount = 0, r.groups.above, 0
	r.mu.Unlock()
	if r.proofs != nil {
		// Learned again as the log is read again.
		r.proofs.pending = nil
		clear(r.proofs.known)
	}
	r.needReload = false
	return nil
}

// registerGauges reports the effects held in open groups,
// leasehold_sink_job_effects_held{leasehold_sink}, and the jobs the chains
// hold above their floors, leasehold_sink_jobs_above_floor.
func (r *Runner) registerGauges() error {
	mp := r.cfg.Telemetry.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter("github.com/leasehold/leasehold/sink/streamsink")
	attrs := metric.WithAttributes(telemetry.AttrSink.String(r.cfg.Name))
	_, err := meter.Int64ObservableGauge("leasehold.sink.job_effects_held",
		metric.WithDescription("Effects of jobs a stream sink holds until the rest of their job is in the log; it stops at Config.MaxHeldEffects."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			held, _ := r.heldEffects()
			o.Observe(int64(held), attrs)
			return nil
		}))
	if err != nil {
		return fmt.Errorf("streamsink: register the held effects gauge: %w", err)
	}
	_, err = meter.Int64ObservableGauge("leasehold.sink.jobs_above_floor",
		metric.WithDescription("Jobs a stream sink remembers applied above their chain's floor, until committed progress or the worker's floors settle them; a chain holds at most 16384."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			_, above := r.heldEffects()
			o.Observe(int64(above), attrs)
			return nil
		}))
	if err != nil {
		return fmt.Errorf("streamsink: register the jobs above floor gauge: %w", err)
	}
	_, err = meter.Int64ObservableGauge("leasehold.sink.jobs_stuck",
		metric.WithDescription("Jobs whose leases the fence records show will commit no more of them, and whose effects a stream sink holds and cannot apply; Ready fails once one has stayed so for Config.StallAfter."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			r.mu.Lock()
			n := r.stuckCount
			r.mu.Unlock()
			o.Observe(int64(n), attrs)
			return nil
		}))
	if err != nil {
		return fmt.Errorf("streamsink: register the stuck jobs gauge: %w", err)
	}
	_, err = meter.Int64ObservableCounter("leasehold.sink.jobs_forgotten",
		metric.WithDescription("Jobs a stream sink forgot having applied, at a chain's bound of jobs above its floor: their effects, should they come again, apply again."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			r.mu.Lock()
			n := r.forgotten
			r.mu.Unlock()
			o.Observe(n, attrs)
			return nil
		}))
	if err != nil {
		return fmt.Errorf("streamsink: register the forgotten jobs counter: %w", err)
	}
	return nil
}
