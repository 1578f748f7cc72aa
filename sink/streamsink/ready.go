package streamsink

import (
	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// The open groups of a chain and lease (a lane) are kept, dropped and
// applied here: what is ready applies (applyReady), an attempt or a group
// proven never to complete is dropped, and a later lease's stamp settles
// the earlier ones (abandon).

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
// job order, until none is: one whose job its chain settled is dropped,
// and one that has a candidate attempt (attempts.go) applies.
//
// With a progress reader, applying a job settles that job alone (a
// final's floor is a marker, and proves nothing: chains.go), so jobs
// complete in any order, each once its After holds, and an open job waits
// for its own attempts or for proof. Without one, the worker's markers are
// trusted: a ready job applies, and the open jobs of its lease up to the
// floor it sets are dropped (aborted, dead-lettered, superseded, as the
// worker's floor says).
func (r *Runner) applyReady(k groupKey, outs *[]outcome) {
	gs := r.groups
	lk := k.laneKey()
	for {
		l := gs.lanes[lk]
		if l == nil {
			return
		}
		ch := gs.chain(k)
		progressed := false
		for _, job := range l.jobs {
			gk := lk.group(job)
			g := gs.open[gk]
			if ch.done(job) {
				r.dropGroup(gk, g, outs)
				progressed = true
				break
			}
			a := r.candidate(gk, g, ch)
			if a == nil {
				continue
			}
			r.apply(gk, g, a, ch, outs)
			progressed = true
			break
		}
		if !progressed {
			return
		}
	}
}

// apply applies group k from attempt a, on a chain that stood at ch, and
// drops its other attempts.
func (r *Runner) apply(k groupKey, g *group, a *attempt, ch applied, outs *[]outcome) {
	gs := r.groups
	*outs = append(*outs, a.held...)
	gs.held -= len(a.held)
	gs.bytes -= a.bytes
	g.remove(a)
	top := max(a.n, g.top())
	final := a.final
	asOrigin := len(a.held) > 0 && !keyNamesJob(leasehold.Stamp{Scope: a.held[0].d.Stamp.Scope, Partition: a.held[0].d.Stamp.Partition, Key: a.finalKey}, k.job)
	r.dropGroup(k, g, outs)
	gs.advance(k, ch, final, top, asOrigin, !r.proven(k.fence))
}

// abandon settles the open groups of fence id below epoch e, whose stamp
// of acquisition acq the runner admitted at log position at: a holder of a
// later lease fenced the partition before it wrote anything, so an earlier
// lease commits nothing more, and every final it committed is in the log
// before here. What the earlier leases completed applies now (as it would
// have: applyReady, until nothing more does), an attempt still incomplete
// never completes, and what cannot apply (a job whose After can no longer
// hold) never will.
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
