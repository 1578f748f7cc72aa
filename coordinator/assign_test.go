package coordinator

import (
	"fmt"
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
	members := []string{"x", "y", "z"}
	got := Assign(4096, members, nil)
	checkBalanced(t, 4096, members, got)
}

func BenchmarkAssign4096x32(b *testing.B) {
	var members []string
	for i := range 32 {
		members = append(members, fmt.Sprintf("worker-%02d", i))
	}
	owners := Assign(4096, members, nil)
	b.ResetTimer()
	for b.Loop() {
		Assign(4096, members, owners)
	}
}

// BenchmarkAssign computes the assignment of 4096 partitions over 32
// members, as every worker does after each change it sees: from nothing
// (a cold start) and from a balanced state, with the scores hashed afresh
// each time (as Assign does) and from the cache a worker keeps.
//
//	go test ./coordinator -run '^$' -bench Assign
func BenchmarkAssign(b *testing.B) {
	const n, k = 4096, 32
	members := make([]string, k)
	for i := range members {
		members[i] = fmt.Sprintf("worker-%02d-abcdef", i)
	}
	free := make([]string, n)
	balanced := Assign(n, members, free)
	for _, c := range []struct {
		name   string
		owners []string
	}{{"cold", free}, {"balanced", balanced}} {
		b.Run(c.name+"/hashed", func(b *testing.B) {
			for b.Loop() {
				assign(n, members, c.owners, nil)
			}
		})
		b.Run(c.name+"/cached", func(b *testing.B) {
			var cache scoreCache
			for b.Loop() {
				assign(n, members, c.owners, &cache)
			}
		})
	}
}
