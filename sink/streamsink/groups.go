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
// every effect it counts, and the job its final names is the last it
// applied for the fence and subject in that lease (or comes before it).
// The job's other attempts are then dropped, reported sink.Aborted, and so
// is an attempt proven never to complete (proofs.go): effects of an
// attempt that did not complete are never applied.
//
// A job counts as applied once its effects were delivered. The last job
// applied per fence and subject is what later jobs' finals are judged
// against (their After), and what takes a job's effects coming again for
// duplicates; a job whose delivery went to the dead-letter stream is
// remembered beside it (applied.Holes), so that its dead letters, replayed,
// apply on their own instead.
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

// chainKey names the effects of one fence on one subject.
type chainKey struct {
	fence   leasehold.FenceID
	subject string
}

// groupKey names one job's effects on one subject under one lease.
type groupKey struct {
	chainKey
	epoch       leasehold.Epoch
	acquisition string
	job         uint64
}

// applied is where a chain stands: the last job decided applied in a lease
// (what a later job's After is judged against) and, of the jobs up to it,
// those whose delivery went to the dead-letter stream, the latest
// maxHoles: they were not applied, and their effects apply on their own
// when they come again (a dead letter replayed).
type applied struct {
	Epoch       leasehold.Epoch
	Acquisition string
	Job         uint64
	Holes       []uint64
	top         uint64 // the highest attempt seen applied in the lease; not saved
}

// maxHoles bounds the dead-lettered jobs a chain remembers.
const maxHoles = 16

// A few emptied lanes are kept for the next groups, so that a job of a
// few effects costs no lane of its own.
const (
	maxSpareLanes = 64
	maxSpareJobs  = 64
)

// hole reports whether job's delivery went to the dead-letter stream.
func (a applied) hole(job uint64) bool {
	for _, h := range a.Holes {
		if h == job {
			return true
		}
	}
	return false
}

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
	bytes   int                  // their data
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

// last is the chain's last applied job in k's lease, 0 when none.
func (gs *groups) last(k groupKey) (applied, uint64) {
	a, ok := gs.applied[k.chainKey]
	if ok && a.Epoch == k.epoch && a.Acquisition == k.acquisition {
		return a, a.Job
	}
	return a, 0
}

// advance records job k applied from an attempt numbered up to top.
func (gs *groups) advance(k groupKey, top uint64) {
	a, _ := gs.last(k)
	gs.advanceFrom(k, a, top)
}

// advanceFrom is advance from a, where the chain stood.
func (gs *groups) advanceFrom(k groupKey, a applied, top uint64) {
	if a.Epoch != k.epoch || a.Acquisition != k.acquisition {
		a = applied{Epoch: k.epoch, Acquisition: k.acquisition}
	}
	a.Job, a.top = k.job, max(a.top, top)
	gs.applied[k.chainKey], gs.delta[k.chainKey] = a, a
}

// addHole records that job k's delivery went to the dead-letter stream.
// It returns the job it forgot to make room, or 0.
func (gs *groups) addHole(k groupKey) uint64 {
	a, last := gs.last(k)
	if last < k.job || a.hole(k.job) {
		return 0 // a later lease's, or known
	}
	var forgot uint64
	holes := make([]uint64, 0, len(a.Holes)+1)
	holes = append(holes, a.Holes...)
	if len(holes) == maxHoles {
		forgot, holes = holes[0], holes[1:]
	}
	a.Holes = append(holes, k.job)
	gs.applied[k.chainKey], gs.delta[k.chainKey] = a, a
	return forgot
}

// heldCopy is the outcome of o held, or handed on, for delivery as an
// effect of job: it is reported when its group is settled.
func heldCopy(o *outcome, job uint64) outcome {
	held := *o
	held.m = &logMsg{seq: o.m.seq, subject: o.m.subject, header: o.m.header, data: o.m.data}
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
	a, last := gs.last(k)
	if mark.Job <= last {
		switch {
		case mark.Abort:
		case a.hole(mark.Job):
			// Its delivery went to the dead-letter stream: this is a
			// replay, and applies on its own.
			o.deliver, o.report, o.job = true, true, mark.Job
		default:
			// Applied already (a replay, or a re-run of an applied job).
			o.report = true
			o.d.Outcome = sink.Duplicate
		}
		return nil
	}
	if !mark.Abort && !keyNamesJob(st, mark.Job) {
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
	if !busy && r.applyAlone(o, k, mark, a, last, outs) {
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
	if gs.held >= r.cfg.MaxHeldEffects || gs.bytes+len(o.m.data) > r.cfg.MaxHeldBytes {
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
	at.bytes += len(o.m.data)
	gs.held++
	gs.bytes += len(o.m.data)
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
	a, _ := gs.last(k)
	top := uint64(0)
	if a.Epoch == k.epoch && a.Acquisition == k.acquisition {
		top = a.top
	}
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
// Anything else (more effects, an open group on the chain, a job before it
// not applied yet, a runner at its held-effects limit) takes the way of
// groups. It is called only for a chain with no open group: no other
// attempt of the job is open, none can rank before this one, and no job
// before it is open.
func (r *Runner) applyAlone(o *outcome, k groupKey, mark leasehold.JobMark, a applied, last uint64, outs *[]outcome) bool {
	gs := r.groups
	if mark.Effects != 1 || mark.Abort || mark.Attempt == 0 || mark.After > last ||
		gs.held >= r.cfg.MaxHeldEffects || gs.bytes+len(o.m.data) > r.cfg.MaxHeldBytes {
		return false
	}
	*outs = append(*outs, heldCopy(o, k.job))
	gs.advanceFrom(k, a, mark.Attempt)
	return true
}

// keepGroup records g under k, or forgets it when it holds nothing worth
// keeping.
func (r *Runner) keepGroup(k groupKey, g *group) {
	gs := r.groups
	if len(g.atts) == 0 && len(g.closed) == 0 {
		r.forgetGroup(k)
		return
	}
	if _, ok := gs.open[k]; ok {
		return
	}
	gs.open[k] = g
	lk := k.laneKey()
	l := gs.lanes[lk]
	if l == nil {
		if n := len(gs.spare); n > 0 {
			l, gs.spare = gs.spare[n-1], gs.spare[:n-1]
		} else {
			l = &lane{}
		}
		gs.lanes[lk] = l
	}
	l.insert(k.job)
	gs.busy[k.chainKey]++
}

// forgetGroup removes group k.
func (r *Runner) forgetGroup(k groupKey) {
	gs := r.groups
	if _, ok := gs.open[k]; !ok {
		return
	}
	delete(gs.open, k)
	lk := k.laneKey()
	if l := gs.lanes[lk]; l != nil {
		l.remove(k.job)
		if len(l.jobs) == 0 {
			delete(gs.lanes, lk)
			if len(gs.spare) < maxSpareLanes && cap(l.jobs) <= maxSpareJobs {
				l.jobs = l.jobs[:0:cap(l.jobs)]
				gs.spare = append(gs.spare, l)
			}
		}
	}
	if gs.busy[k.chainKey]--; gs.busy[k.chainKey] <= 0 {
		delete(gs.busy, k.chainKey)
	}
}

// dropAttempt drops attempt a of g, reporting its effects sink.Aborted.
func (r *Runner) dropAttempt(g *group, a *attempt, outs *[]outcome) {
	for _, o := range a.held {
		o.deliver = false
		o.d.Outcome = sink.Aborted
		*outs = append(*outs, o)
	}
	r.groups.held -= len(a.held)
	r.groups.bytes -= a.bytes
	g.remove(a)
}

// dropGroup drops every attempt of group k and forgets it.
func (r *Runner) dropGroup(k groupKey, g *group, outs *[]outcome) {
	for len(g.atts) > 0 {
		r.dropAttempt(g, g.atts[0], outs)
	}
	r.forgetGroup(k)
}

// applyReady applies the groups of k's chain and lease that are ready, in
// job order: k's, when it comes next, and every one that then comes next.
// With a progress reader, an open job holds back every later job of its
// lease on the chain, until it applies or is proven never to: a later
// job's final names in After the job before it, and a final a forger made
// up could name one below a job still in flight. Without one, the worker's
// After is trusted: a ready job applies, and the open jobs of its lease up
// to it are dropped (aborted, dead-lettered, superseded, as the worker's
// After says).
func (r *Runner) applyReady(k groupKey, outs *[]outcome) {
	gs := r.groups
	lk := k.laneKey()
	proven := r.proven(k.fence)
	for {
		l := gs.lanes[lk]
		if l == nil {
			return
		}
		_, last := gs.last(k)
		progressed := false
		for _, job := range l.jobs {
			gk := lk.group(job)
			g := gs.open[gk]
			if job <= last {
				r.dropGroup(gk, g, outs)
				progressed = true
				break
			}
			if a := r.candidate(gk, g, last); a != nil {
				r.apply(gk, g, a, outs)
				progressed = true
				break
			}
			if proven {
				return
			}
		}
		if !progressed {
			return
		}
	}
}

// apply applies group k from attempt a and drops its other attempts.
func (r *Runner) apply(k groupKey, g *group, a *attempt, outs *[]outcome) {
	gs := r.groups
	*outs = append(*outs, a.held...)
	gs.held -= len(a.held)
	gs.bytes -= a.bytes
	g.remove(a)
	top := max(a.n, g.top())
	r.dropGroup(k, g, outs)
	gs.advance(k, top)
}

// abandon settles the open groups of fence id below epoch e, whose stamp
// of acquisition acq the runner admitted at log position at: a holder of a
// later lease fenced the partition before it wrote anything, so an earlier
// lease commits nothing more, and every final it committed is in the log
// before here. What the earlier leases completed applies now (in job
// order, as it would have), an attempt still incomplete never completes,
// and what cannot apply (a job whose After can no longer hold) never will.
func (r *Runner) abandon(id leasehold.FenceID, e leasehold.Epoch, acq string, at uint64, outs *[]outcome) {
	gs := r.groups
	if r.proofs != nil {
		if pr, ok := r.proofs.known[id]; !ok || pr.p.Epoch < e {
			r.proofs.known[id] = proof{p: sink.Progress{Epoch: e, Acquisition: acq}, at: at}
		}
	}
	var lanes []laneKey
	for lk := range gs.lanes {
		if lk.fence == id && lk.epoch < e {
			lanes = append(lanes, lk)
		}
	}
	for _, lk := range lanes {
		for _, job := range append([]uint64(nil), gs.lanes[lk].jobs...) {
			k := lk.group(job)
			g := gs.open[k]
			for i := 0; i < len(g.atts); {
				if a := g.atts[i]; !a.complete() {
					r.dropAttempt(g, a, outs)
					continue
				}
				i++
			}
			r.keepGroup(k, g)
		}
		r.applyReady(lk.group(0), outs)
		if l := gs.lanes[lk]; l != nil {
			for _, job := range append([]uint64(nil), l.jobs...) {
				r.dropGroup(lk.group(job), gs.open[lk.group(job)], outs)
			}
		}
	}
}

// resetGroups forgets the open groups: the runner reads the log again from
// its saved position (see Runner.reload).
func (r *Runner) resetGroups() {
	old := r.groups
	r.groups = newGroups()
	r.groups.applied, r.groups.delta, r.groups.dirty = old.applied, old.delta, old.dirty
}

// heldEffects returns how many effects the open groups hold.
func (r *Runner) heldEffects() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.heldCount
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
	r.heldCount = 0
	r.mu.Unlock()
	if r.proofs != nil {
		// Learned again as the log is read again.
		r.proofs.pending = nil
		clear(r.proofs.known)
	}
	r.needReload = false
	return nil
}

// registerGauges reports the effects held in open groups:
// leasehold_sink_job_effects_held{leasehold_sink}.
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
			o.Observe(int64(r.heldEffects()), attrs)
			return nil
		}))
	if err != nil {
		return fmt.Errorf("streamsink: register the held effects gauge: %w", err)
	}
	return nil
}
