package streamsink

import (
	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// A packed message nearly always holds a whole attempt of its job on its
// subject: every effect the attempt has there, its final last. On a chain
// with no open group, deciding its effects one by one builds a group, holds
// the effects, and applies them all at the final. decidePacked takes the
// same decisions in one step, as applyAlone does for a job's only effect:
// it checks, before anything changes, every condition under which that
// way would apply the attempt at the final without setting any effect
// aside, and hands the message on to it (decideStamped, effect by effect)
// whenever one of them fails.

// maxPackedFast bounds the effects of a packed message decided in one
// step: the check that its keys are distinct compares each pair.
const maxPackedFast = 32

// decidePacked decides the effects of packed message p, read from the log
// at w's position, in one step and appends their outcomes to outs, or
// reports false, changing nothing, where the effects must be decided one
// by one. The outcomes, their order and the chain's state after them are
// those of the effects decided one by one: each effect's own outcome
// (accepted, acknowledged with the message, reported with its job), and
// the attempt's effects handed on, at the final, in log order.
func (r *Runner) decidePacked(w *work, p *unpacked, outs *[]outcome) bool {
	n := len(p.effects)
	if r.packsOneByOne || n < 2 || n > maxPackedFast {
		return false
	}
	st := p.stamp
	last := &p.effects[n-1]
	mark := last.mark
	// The message holds the whole attempt on its subject: its final
	// counts the effects it packs (read refuses a final that counts fewer).
	if !mark.Final() || mark.Effects != n || mark.Abort || mark.Attempt == 0 {
		return false
	}
	// Every effect is judged as the message's stamp is: Judge reads the
	// stamp's fence, epoch and acquisition, which the effects share, and
	// not its key. A stamp that raises the fence (checked by the
	// verifier, and settling the earlier leases' groups) takes the way
	// of one by one.
	id := st.Fence()
	cur, _ := w.fence(r.fences, id)
	f := cur.state()
	if v, raise := leasehold.Judge(f, st); v != leasehold.Admit || raise {
		return false
	}
	gs := r.groups
	m := &last.m
	chain := chainKey{fence: id, subject: m.subject}
	// No open group on the chain: no other attempt of the job is open,
	// none ranks before this one, and no other job waits on the chain.
	if gs.busy[chain] != 0 {
		return false
	}
	k := groupKey{chainKey: chain, epoch: st.Epoch, acquisition: st.Acquisition, job: mark.Job}
	a := gs.chain(k)
	if a.done(mark.Job) || !a.holds(mark.After) || r.afterCommit(k, m.seq) {
		return false
	}
	// One by one, the effects are held until the final: the limits are
	// checked as each is held.
	if gs.held+n > r.cfg.MaxHeldEffects {
		return false
	}
	size := 0
	for i := range p.effects {
		e := &p.effects[i]
		if !keyNamesJob(e.stamp, mark.Job) && !keyNamesOrigin(e.m.header, e.stamp, mark.Job) {
			return false
		}
		// A key the attempt holds already is a copy, not held again.
		// Unpack refuses a message whose keys repeat: this only keeps
		// the one step from relying on it.
		for j := range i {
			if p.effects[j].stamp.Key == e.stamp.Key {
				return false
			}
		}
		size += heldSize(&e.m)
	}
	if gs.bytes+size > r.cfg.MaxHeldBytes {
		return false
	}

	w.grouped = true
	base := outcome{d: sink.Decision{Subject: m.subject, Position: m.seq, Max: st.Epoch, MaxAcquisition: st.Acquisition, Holder: f.Holder, Outcome: sink.Accepted}}
	for i := range n - 1 {
		o := base
		o.m, o.d.Stamp = &p.effects[i].m, p.effects[i].stamp
		*outs = append(*outs, o)
	}
	for i := range n {
		o := base
		o.m, o.d.Stamp = &p.effects[i].m, p.effects[i].stamp
		if o.m.msg == nil {
			// Not the message's delivery (read gives that to the last
			// effect): shared, where a copy would cost an allocation.
			*outs = append(*outs, sharedCopy(&o, mark.Job))
			continue
		}
		*outs = append(*outs, heldCopy(&o, mark.Job))
	}
	o := base
	o.m, o.d.Stamp = m, last.stamp
	*outs = append(*outs, o)
	gs.advance(k, a, mark, mark.Attempt, !keyNamesJob(last.stamp, mark.Job), !r.proven(id))
	return true
}
