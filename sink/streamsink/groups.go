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
// epoch, acquisition, job), and applies a group, all its effects in one
// call of the handler or one republish round, only once it holds the final
// and every effect it counts, and only when the job its final names is the
// last it applied for the fence and subject in that lease (or comes before
// it). So effects of an attempt that did not complete are never applied:
// one that failed (its abort marker closes it), was superseded by a later
// attempt, was skipped by a later job of the lease, or was cut short by a
// successor's barrier is dropped, reported sink.Aborted.
//
// The saved position never passes the first log position of a group still
// open: a runner that restarts reads the log again from there and finds
// the open groups again. What it applied is saved beside the position, per
// fence and subject (the last job applied, and its lease), so that reading
// again applies no job twice. Effects that carry no job apply on their own,
// as they always did.

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

// applied is the last job applied on a chain.
type applied struct {
	Epoch       leasehold.Epoch
	Acquisition string
	Job         uint64
}

// group is the open attempt of one job's effects on one subject.
type group struct {
	first   uint64    // log position of the first effect held; 0 when none is
	attempt uint64    // the open attempt; 0 when none is open
	closed  uint64    // attempts up to this one are closed for good
	held    []outcome // the open attempt's effects, in log order
	keys    map[string]bool
	bytes   int
	final   leasehold.JobMark // its final, once seen
}

func (g *group) complete() bool { return g.final.Final() && len(g.keys) == g.final.Effects }

// groups is the runner's open job groups and what it applied, as of the
// position it has decided.
type groups struct {
	open    map[groupKey]*group
	chains  map[chainKey]map[groupKey]*group
	applied map[chainKey]applied
	delta   map[chainKey]applied // applied since the shards were written: saved in the position record
	dirty   map[int]bool         // applied shards being written
	held    int                  // effects held in open groups
	bytes   int                  // their data and headers
}

func newGroups() *groups {
	return &groups{open: map[groupKey]*group{}, chains: map[chainKey]map[groupKey]*group{},
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
	if a, ok := gs.applied[chain]; ok && a.Epoch == st.Epoch && a.Acquisition == st.Acquisition && mark.Job <= a.Job {
		// Applied already (a replay, or a re-run of an applied job).
		if !mark.Abort {
			o.report = true
			o.d.Outcome = sink.Duplicate
		}
		return nil
	}
	if r.applyAlone(o, k, mark, outs) {
		return nil
	}
	g := gs.open[k]
	if g == nil {
		g = &group{}
	}
	switch {
	case mark.Attempt <= g.closed || mark.Attempt < g.attempt:
		// A closed or superseded attempt.
		if !mark.Abort {
			o.report, o.d.Outcome = true, sink.Aborted
		}
		return nil
	case mark.Abort:
		r.dropGroup(g, outs)
		g.closed = mark.Attempt
		r.keepGroup(k, g)
		return nil
	case mark.Attempt > g.attempt:
		r.dropGroup(g, outs)
		g.attempt = mark.Attempt
	}
	if gs.held >= r.cfg.MaxHeldEffects || gs.bytes+len(o.m.data) > r.cfg.MaxHeldBytes {
		return fmt.Errorf("%w: %d effects (%d bytes) of jobs whose effects are not all in the log are held (Config.MaxHeldEffects %d, MaxHeldBytes %d); at log position %d, job %d of %s on %s: a worker that died mid-job and whose partition nobody took over leaves its job open, and so do effects of one job spread far apart in the log; raise the limits",
			ErrGroupLimit, gs.held, gs.bytes, r.cfg.MaxHeldEffects, r.cfg.MaxHeldBytes, o.m.seq, mark.Job, chain.fence, chain.subject)
	}
	if g.keys == nil {
		g.keys = map[string]bool{}
	}
	if !g.keys[st.Key] {
		g.keys[st.Key] = true
		held := *o
		held.m = &logMsg{seq: o.m.seq, subject: o.m.subject, header: o.m.header, data: o.m.data}
		held.deliver, held.report, held.term = true, true, false
		g.held = append(g.held, held)
		g.bytes += len(o.m.data)
		gs.held++
		gs.bytes += len(o.m.data)
		if g.first == 0 {
			g.first = o.m.seq
		}
	}
	if mark.Final() {
		g.final = mark
	}
	r.keepGroup(k, g)
	r.applyReady(k, outs)
	return nil
}

// applyAlone applies at once a job's only effect that comes next on a
// chain with no open group, and reports whether it did: what the group
// would do, placed, completed and applied in one step, without building
// it. That is the effect of nearly every job, so it is worth the shortcut.
// Anything else (more effects, an open group on the chain, a job before it
// not applied yet, a runner at its held-effects limit) takes the way of
// groups.
func (r *Runner) applyAlone(o *outcome, k groupKey, mark leasehold.JobMark, outs *[]outcome) bool {
	gs := r.groups
	if mark.Effects != 1 || mark.Abort || mark.Attempt == 0 || gs.chains[k.chainKey] != nil ||
		gs.held >= r.cfg.MaxHeldEffects || gs.bytes+len(o.m.data) > r.cfg.MaxHeldBytes {
		return false
	}
	a, ok := gs.applied[k.chainKey]
	last := uint64(0)
	if ok && a.Epoch == k.epoch && a.Acquisition == k.acquisition {
		last = a.Job
	}
	if mark.After > last {
		return false
	}
	held := *o
	held.m = &logMsg{seq: o.m.seq, subject: o.m.subject, header: o.m.header, data: o.m.data}
	held.deliver, held.report, held.term = true, true, false
	*outs = append(*outs, held)
	done := applied{Epoch: k.epoch, Acquisition: k.acquisition, Job: k.job}
	gs.applied[k.chainKey], gs.delta[k.chainKey] = done, done
	return true
}

// keepGroup records g under k, or forgets it when it holds nothing worth
// keeping.
func (r *Runner) keepGroup(k groupKey, g *group) {
	gs := r.groups
	if g.attempt == 0 && g.closed == 0 {
		delete(gs.open, k)
		if c := gs.chains[k.chainKey]; c != nil {
			delete(c, k)
			if len(c) == 0 {
				delete(gs.chains, k.chainKey)
			}
		}
		return
	}
	gs.open[k] = g
	c := gs.chains[k.chainKey]
	if c == nil {
		c = map[groupKey]*group{}
		gs.chains[k.chainKey] = c
	}
	c[k] = g
}

// dropGroup drops g's open attempt, reporting its effects sink.Aborted.
func (r *Runner) dropGroup(g *group, outs *[]outcome) {
	for _, o := range g.held {
		o.deliver = false
		o.d.Outcome = sink.Aborted
		*outs = append(*outs, o)
	}
	r.groups.held -= len(g.held)
	r.groups.bytes -= g.bytes
	g.held, g.keys, g.bytes, g.first, g.final = nil, nil, 0, 0, leasehold.JobMark{}
	g.closed = max(g.closed, g.attempt)
	g.attempt = 0
}

// applyReady applies group k if it is complete and comes next on its
// chain, then every group of the chain that then comes next.
func (r *Runner) applyReady(k groupKey, outs *[]outcome) {
	gs := r.groups
	for {
		g := gs.open[k]
		if g == nil || !g.complete() {
			return
		}
		a, ok := gs.applied[k.chainKey]
		last := uint64(0)
		if ok && a.Epoch == k.epoch && a.Acquisition == k.acquisition {
			last = a.Job
		}
		if g.final.After > last {
			return // the job before it has not been applied yet
		}
		*outs = append(*outs, g.held...)
		gs.held -= len(g.held)
		gs.bytes -= g.bytes
		gs.applied[k.chainKey] = applied{Epoch: k.epoch, Acquisition: k.acquisition, Job: k.job}
		gs.delta[k.chainKey] = gs.applied[k.chainKey]
		// The chain's groups of the lease up to this job were skipped by
		// the worker: aborted, dead-lettered, superseded.
		var next *groupKey
		for ok2, og := range gs.chains[k.chainKey] {
			if ok2.epoch != k.epoch || ok2.acquisition != k.acquisition {
				continue
			}
			if ok2.job <= k.job {
				if ok2.job != k.job {
					r.dropGroup(og, outs)
				}
				og.attempt, og.closed = 0, 0
				r.keepGroup(ok2, og)
				continue
			}
			if og.complete() && og.final.After <= k.job && (next == nil || ok2.job < next.job) {
				nk := ok2
				next = &nk
			}
		}
		if next == nil {
			return
		}
		k = *next
	}
}

// abandon drops the open groups of fence id below epoch e: a holder of a
// later lease has fenced the partition, and whatever the earlier ones did
// not complete never will.
func (r *Runner) abandon(id leasehold.FenceID, e leasehold.Epoch, outs *[]outcome) {
	gs := r.groups
	for k, g := range gs.open {
		if k.fence == id && k.epoch < e {
			r.dropGroup(g, outs)
			g.attempt, g.closed = 0, 0
			r.keepGroup(k, g)
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
