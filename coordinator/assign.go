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
	return assign(n, members, owners, nil)
}

// assign is Assign with the members' scores taken from cache, which keeps
// each member's score for every partition: a worker recomputes the
// assignment after every change it sees, and with thousands of partitions
// the hashing would otherwise dominate it.
func assign(n int, members []string, owners []string, cache *scoreCache) []string {
	target := make([]string, n)
	if len(members) == 0 || n == 0 {
		return target
	}
	members = slices.Clone(members)
	slices.Sort(members)
	members = slices.Compact(members)
	scores := make([][]uint64, len(members))
	for i, m := range members {
		scores[i] = cache.of(m, n)
	}
	index := make(map[string]int, len(members))
	for i, m := range members {
		index[m] = i
	}

	held := make([][]int, len(members))
	for p := 0; p < n && p < len(owners); p++ {
		if i, ok := index[owners[p]]; ok {
			held[i] = append(held[i], p)
		}
	}

	// Shares: the extra partitions go to the members holding the most now,
	// which keeps moves to the minimum.
	order := make([]int, len(members))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(len(held[b]), len(held[a])) })
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
	// which is what every member is in a steady group: the sort is what
	// recomputing the assignment after each change would otherwise spend
	// most of its time on.
	taken := make([]int, len(members))
	for i, ps := range held {
		if len(ps) > share[i] {
			sc := scores[i]
			slices.SortFunc(ps, func(a, b int) int {
				return cmp.Or(cmp.Compare(sc[b], sc[a]), cmp.Compare(a, b))
			})
		}
		for _, p := range ps[:min(len(ps), share[i])] {
			target[p] = members[i]
			taken[i]++
		}
	}

	for p := range target {
		if target[p] != "" {
			continue
		}
		best := -1
		var bestScore uint64
		for i := range members {
			if taken[i] >= share[i] {
				continue
			}
			if s := scores[i][p]; best < 0 || s > bestScore {
				best, bestScore = i, s
			}
		}
		target[p] = members[best]
		taken[best]++
	}
	return target
}

// score is the rendezvous weight of member m for partition p: FNV-1a over
// the member and the partition number, then a 64-bit finaliser.
func score(p int, m string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(m); i++ {
		h ^= uint64(m[i])
		h *= 1099511628211
	}
	for i := 0; i < 4; i++ {
		h ^= uint64(byte(p >> (8 * i)))
		h *= 1099511628211
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9a34f5e7f93
	h ^= h >> 33
	return h
}

// scoreCache keeps every member's rendezvous score for each partition. A
// nil cache computes them afresh.
type scoreCache struct {
	by map[string][]uint64
}

// of returns m's scores for partitions 0..n-1.
func (c *scoreCache) of(m string, n int) []uint64 {
	if c != nil {
		if s, ok := c.by[m]; ok && len(s) == n {
			return s
		}
	}
	s := make([]uint64, n)
	for p := range s {
		s[p] = score(p, m)
	}
	if c != nil {
		if c.by == nil {
			c.by = map[string][]uint64{}
		}
		c.by[m] = s
	}
	return s
}

// keep forgets the members not in live, so that the cache does not grow
// with every worker that ever came and went.
func (c *scoreCache) keep(live map[string]bool, me string) {
	for m := range c.by {
		if !live[m] && m != me {
			delete(c.by, m)
		}
	}
}
