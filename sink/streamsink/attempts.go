package streamsink

import (
	"time"

	"github.com/leasehold/leasehold"
)

// A job's group keeps its attempts apart: a worker runs one attempt of a
// job at a time and numbers them in that order, but the log can hold
// several of one job at once (a failed attempt and its retry, a rewind's
// re-run, a forger's copies), and which of them the job applies from is
// decided by rank, not by whichever marker came last.
//
// Attempts rank in the order they first appear in the log. For a worker's
// own attempts that is the order of their numbers; one that appears after
// a higher-numbered attempt of its job is not the worker's (SuspectAttemptOrder)
// and ranks after it. The job applies from the first attempt, by rank, that
// is complete (its final and at least as many effects as the final counts)
// and whose final's After holds. With a progress reader, an attempt ranked
// before it that may still complete holds it back: an incomplete attempt
// until proof that it never completes (progress.go), a complete one whose
// After does not hold yet unless it never can. Markers prove nothing: an
// abort only marks its attempt (a hint), a higher number supersedes
// nothing. Without a progress reader the runner trusts the markers as the
// worker writes them: an abort closes its own attempt, and nothing ranked
// before a complete attempt whose After holds keeps it back.

// group is one job's effects on one subject under one lease.
type group struct {
	atts   []*attempt // in the order they first appeared in the log
	first  uint64     // log position of the first effect held, over its attempts; 0 when none
	closed []uint64   // without a progress reader: attempts an abort closed, the latest
	born   uint64     // the progress round it opened in (proofs.go)
	// stuck is when a round of records first showed the group's job
	// settled while it stayed open (proofs.go), or zero.
	stuck time.Time

	// The first attempt, nearly always the only one, and room for atts,
	// come with the group: a job of a few effects costs one allocation.
	one     attempt
	oneUsed bool
	arr     [2]*attempt
}

// attempt is one attempt's effects in a group.
type attempt struct {
	n        uint64
	first    uint64    // log position of its first effect held
	held     []outcome // its effects, in log order
	heldArr  [3]outcome
	keys     keySet
	bytes    int
	final    leasehold.JobMark // its final, once seen
	finalKey string
	// aborted: an abort marker of the attempt came (a hint: it proves
	// nothing with a progress reader); abort is that marker, to be
	// reported suspicious should the final come after it.
	aborted bool
	abort   *outcome
	over    bool // reported holding more effects than its final counts
}

// maxClosed bounds the closed attempts a group remembers.
const maxClosed = 8

func (a *attempt) complete() bool { return a.final.Final() && a.keys.len() >= a.final.Effects }

// add opens attempt n, first seen at log position pos, ranked last.
func (g *group) add(n, pos uint64) *attempt {
	var a *attempt
	if !g.oneUsed {
		g.oneUsed, a = true, &g.one
	} else {
		a = &attempt{}
	}
	a.n, a.first = n, pos
	a.held = a.heldArr[:0]
	if g.atts == nil {
		g.atts = g.arr[:0]
	}
	g.atts = append(g.atts, a)
	if g.first == 0 || pos < g.first {
		g.first = pos
	}
	return a
}

// find returns attempt n of g, or nil.
func (g *group) find(n uint64) *attempt {
	for _, a := range g.atts {
		if a.n == n {
			return a
		}
	}
	return nil
}

// top is the highest attempt number g holds.
func (g *group) top() uint64 {
	var n uint64
	for _, a := range g.atts {
		n = max(n, a.n)
	}
	return n
}

func (g *group) isClosed(n uint64) bool {
	for _, c := range g.closed {
		if c == n {
			return true
		}
	}
	return false
}

func (g *group) close(n uint64) {
	if len(g.closed) == maxClosed {
		g.closed = g.closed[1:]
	}
	g.closed = append(g.closed, n)
}

// remove takes attempt a out of g and recomputes g.first.
func (g *group) remove(a *attempt) {
	for i, x := range g.atts {
		if x == a {
			g.atts = append(g.atts[:i], g.atts[i+1:]...)
			break
		}
	}
	g.first = 0
	for _, x := range g.atts {
		if x.first != 0 && (g.first == 0 || x.first < g.first) {
			g.first = x.first
		}
	}
}

// keySet is the idempotency keys an attempt holds: a few, searched in
// order, and a map once they are many.
type keySet struct {
	list []string
	arr  [4]string
	m    map[string]struct{}
}

const keySetList = 8

func (s *keySet) has(k string) bool {
	if s.m != nil {
		_, ok := s.m[k]
		return ok
	}
	for _, x := range s.list {
		if x == k {
			return true
		}
	}
	return false
}

func (s *keySet) add(k string) {
	if s.list == nil && s.m == nil {
		s.list = s.arr[:0]
	}
	if s.m == nil && len(s.list) < keySetList {
		s.list = append(s.list, k)
		return
	}
	if s.m == nil {
		s.m = make(map[string]struct{}, 2*keySetList)
		for _, x := range s.list {
			s.m[x] = struct{}{}
		}
		s.list = nil
	}
	s.m[k] = struct{}{}
}

func (s *keySet) len() int {
	if s.m != nil {
		return len(s.m)
	}
	return len(s.list)
}

// candidate returns the attempt group k applies from now, or nil while it
// must wait: see the rules above. ch is where k's chain stands in k's
// lease.
//
// An attempt that holds both its abort marker and its final is disputed:
// one of the two is not the worker's. A worker sends a final and then an
// abort only when it ran the job again (its finals on other subjects
// failed), and then commits the later attempt; it never sends a final
// after an abort. So, with a progress reader, a disputed attempt waits
// until the job is settled, and applies only if no complete attempt ranks
// after it.
func (r *Runner) candidate(k groupKey, g *group, ch applied) *attempt {
	proven := r.proven(k.fence)
	for i, a := range g.atts {
		if !a.complete() {
			if proven {
				return nil
			}
			continue
		}
		if proven && a.aborted {
			if !r.settledJob(k) {
				return nil
			}
			if laterComplete(g.atts[i+1:]) {
				continue
			}
		}
		if ch.holds(a.final.After) {
			return a
		}
		if proven && !r.hopeless(k, a.final.After, ch) {
			return nil
		}
	}
	return nil
}

func laterComplete(atts []*attempt) bool {
	for _, a := range atts {
		if a.complete() {
			return true
		}
	}
	return false
}

// hopeless reports whether the job after can never be settled on k's
// chain before k's job, so that an attempt of k whose final names it never
// applies: the fence record shows that k's lease will commit no more of
// k's job, the runner has read everything that lease could commit, and no
// open job of the lease holds a complete attempt that could settle after
// while k is open: after's own (with committed progress to read, a
// final's floor settles nothing: chains.go).
// A worker commits a job only once every job whose finals it sent before
// the job's own is finished, the job its final names among them, so a
// committed job's After is settled, or complete in the log.
func (r *Runner) hopeless(k groupKey, after uint64, ch applied) bool {
	if ch.holds(after) || !r.settledJob(k) {
		return false
	}
	gs := r.groups
	l := gs.lanes[k.laneKey()]
	if l == nil {
		return true
	}
	for _, job := range l.jobs {
		if job == k.job {
			continue
		}
		for _, a := range gs.open[k.withJob(job)].atts {
			if !a.complete() {
				continue
			}
			if job == after {
				return false
			}
		}
	}
	return true
}

// laneKey names the open groups of one chain in one lease.
type laneKey struct {
	chainKey
	epoch       leasehold.Epoch
	acquisition string
}

func (k groupKey) laneKey() laneKey {
	return laneKey{chainKey: k.chainKey, epoch: k.epoch, acquisition: k.acquisition}
}

func (k groupKey) withJob(job uint64) groupKey { k.job = job; return k }

func (l laneKey) group(job uint64) groupKey {
	return groupKey{chainKey: l.chainKey, epoch: l.epoch, acquisition: l.acquisition, job: job}
}

// lane is the jobs of one chain and lease with an open group, ascending.
// Jobs come in order as a rule, and leave from the front.
type lane struct {
	jobs []uint64
}

// find returns the index of the first job at or above job.
func (l *lane) find(job uint64) int {
	lo, hi := 0, len(l.jobs)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if l.jobs[m] < job {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

func (l *lane) insert(job uint64) {
	if n := len(l.jobs); n == 0 || l.jobs[n-1] < job {
		l.jobs = append(l.jobs, job)
		return
	}
	i := l.find(job)
	if i < len(l.jobs) && l.jobs[i] == job {
		return
	}
	l.jobs = append(l.jobs, 0)
	copy(l.jobs[i+1:], l.jobs[i:])
	l.jobs[i] = job
}

func (l *lane) remove(job uint64) {
	i := l.find(job)
	switch {
	case i >= len(l.jobs) || l.jobs[i] != job:
	case i == 0:
		l.jobs = l.jobs[1:]
	default:
		l.jobs = append(l.jobs[:i], l.jobs[i+1:]...)
	}
}

// keyNamesJob reports whether an effect's idempotency key is one a worker
// gives an effect of job: leasehold.EffectKey(scope, partition, job, i).
func keyNamesJob(st leasehold.Stamp, job uint64) bool {
	key := st.Key
	if len(key) <= len(st.Scope) || key[:len(st.Scope)] != st.Scope || key[len(st.Scope)] != '.' {
		return false
	}
	rest := key[len(st.Scope)+1:]
	var ok bool
	if rest, ok = cutNumber(rest, uint64(st.Partition)); !ok || rest == "" || rest[0] != '.' {
		return false
	}
	if rest, ok = cutNumber(rest[1:], job); !ok || len(rest) < 2 || rest[0] != '.' {
		return false
	}
	for i := 1; i < len(rest); i++ {
		if c := rest[i]; c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// keyNamesOrigin reports whether an effect of job carries the keys of
// the job's origin (leasehold.HeaderOrigin, which a worker writes on the
// effects of a job stored again, by a replay): the origin must read
// strictly, come before the job where both are in the same partition of
// the same scope, and the key be one a worker gives an effect there.
func keyNamesOrigin(h map[string][]string, st leasehold.Stamp, job uint64) bool {
	org, ok, err := leasehold.OriginFromHeader(h)
	if !ok || err != nil {
		return false
	}
	if org.Scope == st.Scope && org.Partition == st.Partition && org.Seq >= job {
		return false
	}
	return keyNamesJob(leasehold.Stamp{Scope: org.Scope, Partition: org.Partition, Key: st.Key}, org.Seq)
}

// otherKeys reports whether an effect of job, which a chain at a applied,
// carries the other set of the job's keys than the attempt applied: its
// own where that attempt carried its origin's, or the reverse.
func otherKeys(h map[string][]string, st leasehold.Stamp, job uint64, a applied) bool {
	own := keyNamesJob(st, job)
	if !own && !keyNamesOrigin(h, st, job) {
		return false
	}
	return own == a.appliedAsOrigin(job)
}

// cutNumber cuts the canonical decimal of n from the front of s.
func cutNumber(s string, n uint64) (string, bool) {
	var buf [20]byte
	i := len(buf)
	for {
		i--
		buf[i] = byte('0' + n%10)
		n /= 10
		if n == 0 {
			break
		}
	}
	d := buf[i:]
	if len(s) < len(d) || s[:len(d)] != string(d) {
		return s, false
	}
	return s[len(d):], true
}
