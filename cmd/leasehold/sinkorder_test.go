package main

import (
	"slices"
	"testing"
)

// sink ls lists keys as people count: a partition's 10th key after its
// 9th, not between its 1st and 2nd.
func TestNaturalCompare(t *testing.T) {
	t.Parallel()
	got := []string{"orders.3.90", "orders.10.1", "orders.3.10", "orders.3.9", "orders.3.09", "orders.3", "orders.2.100", "orders.b", "orders.a", "orders.3.9a"}
	slices.SortFunc(got, naturalCompare)
	want := []string{"orders.2.100", "orders.3", "orders.3.09", "orders.3.9", "orders.3.9a", "orders.3.10", "orders.3.90", "orders.10.1", "orders.a", "orders.b"}
	if !slices.Equal(got, want) {
		t.Errorf("natural order:\n got %q\nwant %q", got, want)
	}
	for _, c := range [][2]string{{"a", "a"}, {"7", "007"}, {"x1y", "x01y"}} {
		if naturalCompare(c[0], c[1]) == 0 && c[0] != c[1] {
			t.Errorf("%q and %q compare equal: the order must be total", c[0], c[1])
		}
		if naturalCompare(c[0], c[1]) != -naturalCompare(c[1], c[0]) {
			t.Errorf("%q and %q: the order is not antisymmetric", c[0], c[1])
		}
	}
}
