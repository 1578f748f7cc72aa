package coordinator

import (
	"cmp"
	"slices"
)

// Assign computes which member should own each of n partitions, given the
// live members and the current owners (owners[p] is "" when p is free; an
// owner that is not a member counts as free). Every worker computes it from
// the same bucket contents and gets the same answer, so no central process
// is needed.
//
// The assignment is balanced (every member gets n/len(members) partitions,
// and the first n%len(members) members in order of current holdings get one
// more) and sticky: a member keeps as many of its current partitions as its
// share allows, so a join or leave moves only the partitions it must. Free
// partitions go, lowest first, to the member with room that ranks highest
// for that partition by rendezvous hashing, which spreads them evenly and
// deterministically.
func Assign(n int, members []string, owners []string) []string {
	a := newAssigner(n)
	a.setMembers(members)
	target := make([]string, n)
	for p, i := range a.assign(owners) {
		if i >= 0 {
			target[p] = a.members[i]
		}
	}
	return target
}

// assigner computes Assign for one worker group, as a worker does after
// every change it sees. It keeps, for every partition, the member that
// ranks highest for it (its first choice) and that member's score, and
// updates them as members come and go: a join costs a score per partition,
// a leave a score per member for the partitions whose first choice left.
// A free partition whose first choice has room needs no scores at all;
// only those whose first choice is full are ranked over every member,
// which in a balanced fill is a few hundred of 65,536. Recomputing every
// member's score for every partition at each change (or keeping them all,
// 32 MiB at 65,536 partitions over 64 members) was what a cold start of
// that size spent most of its CPU on.
type assigner struct {
	n       int
	members []string       // sorted, distinct
	pre     []uint64       // nameHash of each member, by index in members
	index   map[string]int // members' indexes
	// first[p] is the index in members of p's first choice, -1 with no
	// members; firstScore[p] its score. Ties go to the member that sorts
	// first, as in a scan of members in order.
	first      []int32
	firstScore []uint64
}

func newAssigner(n int) *assigner {
	a := &assigner{n: n, index: map[string]int{}, first: make([]int32, n), firstScore: make([]uint64, n)}
	for p := range a.first {
		a.first[p] = -1
	}
	return a
}

// setMembers makes members (in any order, repeats allowed) the group's
// membership.
func (a *assigner) setMembers(members []string) {
	next := slices.Clone(members)
	slices.Sort(next)
	next = slices.Compact(next)
	if slices.Equal(next, a.members) {
		return
	}
	keep := make(map[string]bool, len(next))
	for _, m := range next {
		keep[m] = true
	}
	var added []string
	for _, m := range next {
		if _, ok := a.index[m]; !ok {
			added = append(added, m)
		}
	}
	// Old index -> new index (-1: left), so that first choices survive the
	// renumbering that sorted insertion brings.
	index := make(map[string]int, len(next))
	pre := make([]uint64, len(next))
	for i, m := range next {
		index[m] = i
		if j, ok := a.index[m]; ok {
			pre[i] = a.pre[j]
		} else {
			pre[i] = nameHash(m)
		}
	}
	renumber := make([]int32, len(a.members))
	for j, m := range a.members {
		if keep[m] {
			renumber[j] = int32(index[m])
		} else {
			renumber[j] = -1
		}
	}
	a.members, a.pre, a.index = next, pre, index
	for p, f := range a.first {
		if f < 0 {
			continue
		}
		if a.first[p] = renumber[f]; a.first[p] < 0 {
			a.rank(p)
		}
	}
	for _, m := range added {
		i := int32(index[m])
		h := pre[i]
		for p := range a.first {
			s := scoreOf(h, p)
			if f := a.first[p]; f < 0 || s > a.firstScore[p] || (s == a.firstScore[p] && i < f) {
				a.first[p], a.firstScore[p] = i, s
			}
		}
	}
}

// rank sets p's first choice from a scan of every member.
func (a *assigner) rank(p int) {
	a.first[p] = -1
	for i, h := range a.pre {
		if s := scoreOf(h, p); a.first[p] < 0 || s > a.firstScore[p] {
			a.first[p], a.firstScore[p] = int32(i), s
		}
	}
}

// assign is Assign over the current members, each partition's member
// given by its index in a.members (-1 with no members).
func (a *assigner) assign(owners []string) []int32 {
	n, members := a.n, a.members
	target := make([]int32, n)
	for p := range target {
		target[p] = -1
	}
	if len(members) == 0 || n == 0 {
		return target
	}
	held := make([][]int, len(members))
	for p := 0; p < n && p < len(owners); p++ {
		if owners[p] == "" {
			continue
		}
		if i, ok := a.index[owners[p]]; ok {
			held[i] = append(held[i], p)
		}
	}

	// Shares: the extra partitions go to the members holding the most now,
	// which keeps moves to the minimum.
	order := make([]int, len(members))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(x, y int) int { return cmp.Compare(len(held[y]), len(held[x])) })
	share := make([]int, len(members))
	base, extra := n/len(members), n%len(members)
	for rank, i := range order {
		share[i] = base
		if rank < extra {
			share[i]++
		}
	}

	// Keep what each member may keep: the partitions it ranks highest.
	// A member within its share keeps all of them, and needs no ranking,
	// which is what every member is in a steady group.
	taken := make([]int, len(members))
	for i, ps := range held {
		if len(ps) > share[i] {
			type ranked struct {
				p int
				s uint64
			}
			rs := make([]ranked, len(ps))
			for j, p := range ps {
				rs[j] = ranked{p, scoreOf(a.pre[i], p)}
			}
			slices.SortFunc(rs, func(x, y ranked) int { return cmp.Or(cmp.Compare(y.s, x.s), cmp.Compare(x.p, y.p)) })
			for j := range ps {
				ps[j] = rs[j].p
			}
		}
		for _, p := range ps[:min(len(ps), share[i])] {
			target[p] = int32(i)
			taken[i]++
		}
	}

	for p := range target {
		if target[p] >= 0 {
			continue
		}
		best := int(a.first[p])
		if taken[best] >= share[best] {
			// Its first choice is full: the best member with room.
			best = -1
			var bestScore uint64
			for i, h := range a.pre {
				if taken[i] >= share[i] {
					continue
				}
				if s := scoreOf(h, p); best < 0 || s > bestScore {
					best, bestScore = i, s
				}
			}
		}
		target[p] = int32(best)
		taken[best]++
	}
	return target
}

const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// score is the rendezvous weight of member m for partition p: FNV-1a over
// the member and the partition number, then a 64-bit finaliser.
func score(p int, m string) uint64 { return scoreOf(nameHash(m), p) }

// nameHash is FNV-1a's state after the bytes of m.
func nameHash(m string) uint64 {
	h := uint64(fnvOffset)
	for i := 0; i < len(m); i++ {
		h ^= uint64(m[i])
		h *= fnvPrime
	}
	return h
}

// scoreOf continues h, a member's nameHash, over partition p's four bytes
// and finalises it.
func scoreOf(h uint64, p int) uint64 {
	for i := 0; i < 4; i++ {
		h ^= uint64(byte(p >> (8 * i)))
		h *= fnvPrime
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9a34f5e7f93
	h ^= h >> 33
	return h
}

// indexOf returns member m's index in a.members, or -1 when it is not one.
func (a *assigner) indexOf(m string) int32 {
	if i, ok := a.index[m]; ok {
		return int32(i)
	}
	return -1
}
