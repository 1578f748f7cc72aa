package testskip

import (
	"slices"
	"testing"
)

// Skips and partial runs are counted per need and per test, and the
// summary names the package, the count, what is missing and how to get it.
func TestSummary(t *testing.T) {
	for _, name := range []string{"a", "b"} {
		t.Run(name, func(t *testing.T) { Skip(t, PostgreSQL, "no PostgreSQL here") })
	}
	t.Run("c", func(t *testing.T) { Partial(t, NetNS, "partition: not running as root") })
	t.Run("d", func(t *testing.T) { Skip(t, SPIN, "no spin here") })
	want := []string{
		"leasehold: internal/testskip: 2 tests skipped: PostgreSQL's initdb not found; apt-get install postgresql",
		"leasehold: internal/testskip: 1 test ran in part: no network partitions (they need root, ip and nft); run as root after apt-get install iproute2 nftables",
		"leasehold: internal/testskip: 1 test skipped: spin or gcc not found; apt-get install spin gcc",
	}
	if got := Summary(); !slices.Equal(got, want) {
		t.Fatalf("summary:\n%q\nwant:\n%q", got, want)
	}
}
