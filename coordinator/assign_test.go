package coordinator

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func counts(target []string) map[string]int {
	c := map[string]int{}
	for _, m := range target {
		c[m]++
	}
	return c
}

func checkBalanced(t *testing.T, n int, members []string, target []string) {
	t.Helper()
	c := counts(target)
	if c[""] != 0 {
		t.Fatalf("%d partitions unassigned", c[""])
	}
	lo, hi := n, 0
	for _, m := range members {
		lo, hi = min(lo, c[m]), max(hi, c[m])
	}
	if hi-lo > 1 {
		t.Fatalf("unbalanced: %v", c)
	}
}

func moved(before, after []string) int {
	n := 0
	for p := range before {
		if before[p] != "" && before[p] != after[p] {
			n++
		}
	}
	return n
}

func TestAssignBalancedAndSticky(t *testing.T) {
	t.Parallel()
	const n = 64
	ws := func(k int) []string {
		var m []string
		for i := range k {
			m = append(m, fmt.Sprintf("w%d", i))
		}
		return m
	}
	owners := make([]string, n)
	a3 := Assign(n, ws(3), owners)
	checkBalanced(t, n, ws(3), a3)
	if !slices.Equal(a3, Assign(n, ws(3), a3)) {
		t.Fatal("assignment is not stable once reached")
	}
	a5 := Assign(n, ws(5), a3)
	checkBalanced(t, n, ws(5), a5)
	// 3 workers hold 22+21+21; 5 hold 13,13,13,13,12: the newcomers take 25,
	// and nothing else may move.
	if got := moved(a3, a5); got != 25 {
		t.Fatalf("3->5 moved %d partitions, want 25", got)
	}
	a2 := Assign(n, []string{"w0", "w1"}, a5)
	checkBalanced(t, n, []string{"w0", "w1"}, a2)
	// w2, w3 and w4 leave with 38 partitions between them; w0 and w1 keep
	// their 26 and take those 38.
	if got := moved(a5, a2); got != 38 {
		t.Fatalf("5->2 moved %d partitions, want 38", got)
	}
	// The member order given does not matter.
	if !slices.Equal(Assign(n, []string{"w4", "w2", "w0", "w3", "w1"}, a3), a5) {
		t.Fatal("assignment depends on member order")
	}
}

func TestAssignSmallAndEdgeCases(t *testing.T) {
	t.Parallel()
	if got := Assign(4, nil, nil); !slices.Equal(got, make([]string, 4)) {
		t.Fatalf("no members: %v", got)
	}
	// P < W: some members get nothing, nobody gets two.
	got := Assign(3, []string{"a", "b", "c", "d", "e"}, nil)
	checkBalanced(t, 3, []string{"a", "b", "c", "d", "e"}, got)
	// P=10, W=4: shares 3,3,2,2 even when one member holds everything.
	owners := slices.Repeat([]string{"a"}, 10)
	got = Assign(10, []string{"a", "b", "c", "d"}, owners)
	checkBalanced(t, 10, []string{"a", "b", "c", "d"}, got)
	if c := counts(got); c["a"] != 3 {
		t.Fatalf("the member holding everything should keep 3: %v", c)
	}
	// Owners that are not members count as free.
	got = Assign(4, []string{"a"}, []string{"gone", "gone", "a", ""})
	for p, m := range got {
		if m != "a" {
			t.Fatalf("partition %d -> %q", p, m)
		}
	}
}

func TestAssignSpreadsFreshPartitionsEvenly(t *testing.T) {
	t.Parallel()
	members := []string{"x", "y", "z"}
	got := Assign(4096, members, nil)
	checkBalanced(t, 4096, members, got)
}

// BenchmarkAssign computes the assignment as every worker does after each
// change it sees: from nothing (a cold start) and from a balanced state, at
// 4096 partitions over 32 members and 65,536 over 64; fresh as Assign does,
// and kept as a worker keeps its assigner between changes.
//
//	go test ./coordinator -run '^$' -bench 'Assign$'
func BenchmarkAssign(b *testing.B) {
	for _, size := range []struct{ n, k int }{{4096, 32}, {65536, 64}} {
		members := make([]string, size.k)
		for i := range members {
			members[i] = fmt.Sprintf("worker-%02d-abcdef", i)
		}
		free := make([]string, size.n)
		balanced := Assign(size.n, members, free)
		for _, c := range []struct {
			name   string
			owners []string
		}{{"cold", free}, {"balanced", balanced}} {
			b.Run(fmt.Sprintf("%dx%d/%s/fresh", size.n, size.k, c.name), func(b *testing.B) {
				for b.Loop() {
					Assign(size.n, members, c.owners)
				}
			})
			b.Run(fmt.Sprintf("%dx%d/%s/kept", size.n, size.k, c.name), func(b *testing.B) {
				a := newAssigner(size.n)
				for b.Loop() {
					a.setMembers(members)
					a.assign(c.owners)
				}
			})
		}
	}
}

// assignReference is the assignment as its definition states it, every
// member's score computed for every free partition: the assigner, which
// keeps first choices across membership changes, must agree with it
// exactly, or workers of different versions would disagree.
func assignReference(n int, members []string, owners []string) []string {
	target := make([]string, n)
	if len(members) == 0 || n == 0 {
		return target
	}
	members = slices.Clone(members)
	slices.Sort(members)
	members = slices.Compact(members)
	index := map[string]int{}
	for i, m := range members {
		index[m] = i
	}
	held := make([][]int, len(members))
	for p := 0; p < n && p < len(owners); p++ {
		if i, ok := index[owners[p]]; ok {
			held[i] = append(held[i], p)
		}
	}
	order := make([]int, len(members))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(len(held[b]), len(held[a])) })
	share := make([]int, len(members))
	for rank, i := range order {
		share[i] = n / len(members)
		if rank < n%len(members) {
			share[i]++
		}
	}
	taken := make([]int, len(members))
	for i, ps := range held {
		slices.SortFunc(ps, func(a, b int) int {
			return cmp.Or(cmp.Compare(score(b, members[i]), score(a, members[i])), cmp.Compare(a, b))
		})
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
		for i, m := range members {
			if taken[i] < share[i] {
				if s := score(p, m); best < 0 || s > bestScore {
					best, bestScore = i, s
				}
			}
		}
		target[p] = members[best]
		taken[best]++
	}
	return target
}

// One assigner, kept across a random history of joins, leaves and holdings
// (as a worker keeps it), gives exactly the reference assignment at every
// step; so does Assign.
func TestAssignerMatchesTheDefinition(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(7, 11))
	for _, n := range []int{1, 7, 64, 1000} {
		a := newAssigner(n)
		var members []string
		owners := make([]string, n)
		for step := range 200 {
			switch r := rng.IntN(10); {
			case r < 4 || len(members) == 0:
				members = append(members, fmt.Sprintf("w%d", rng.IntN(40)))
			case r < 6:
				i := rng.IntN(len(members))
				members = slices.Delete(members, i, i+1)
			default:
				for range rng.IntN(n) + 1 {
					owners[rng.IntN(n)] = fmt.Sprintf("w%d", rng.IntN(45)) // some not members
				}
				if rng.IntN(4) == 0 {
					owners[rng.IntN(n)] = ""
				}
			}
			want := assignReference(n, members, owners)
			a.setMembers(members)
			got := make([]string, n)
			for p, i := range a.assign(owners) {
				if i >= 0 {
					got[p] = a.members[i]
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("n=%d step %d members %v: the assigner differs from the definition", n, step, members)
			}
			if got := Assign(n, members, owners); !slices.Equal(got, want) {
				t.Fatalf("n=%d step %d members %v: Assign differs from the definition", n, step, members)
			}
			if step%3 == 0 {
				owners = want // the group converges to what it computed
			}
		}
	}
}
