package bench

import (
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

func TestIOKeysSpreadEvenly(t *testing.T) {
	t.Parallel()
	keys := ioKeys(16, 960)
	if len(keys) != 960 {
		t.Fatalf("%d keys, want 960", len(keys))
	}
	seen := map[string]bool{}
	for i, k := range keys {
		if seen[string(k)] {
			t.Fatalf("key %q twice", k)
		}
		seen[string(k)] = true
		if p := leasehold.PartitionFor(k, 16); int(p) != i%16 {
			t.Fatalf("key %d (%q) lands on partition %d, want %d", i, k, p, i%16)
		}
	}
}

func TestIOSetupInFlight(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		partitions, procs, perPartition, want int
	}{
		{4, 1, 1, 4},      // one job a partition: as many as held
		{16, 4, 1, 16},    // ... across processes
		{4, 1, 16, 64},    // 4 own slots and 4 × 15 of the pool's 100
		{16, 1, 16, 116},  // 16 own slots and 16 × 15 = 240 bounded by the pool's 100
		{16, 4, 16, 256},  // 4 × 16 in each of 4 processes
		{16, 2, 16, 216},  // 8 own slots and 8 × 15 = 120 bounded to 100, in each of 2
		{256, 1, 16, 356}, // every held partition runs one, whatever the bound
	} {
		s := newIOSetup(c.partitions, c.procs)
		s.partitionConcurrency = c.perPartition
		if got := s.inFlight(); got != c.want {
			t.Errorf("%d partitions, %d processes, %d a partition: %d in flight, want %d", c.partitions, c.procs, c.perPartition, got, c.want)
		}
	}
}

func TestIOSetupWorkerArgs(t *testing.T) {
	t.Parallel()
	s := newIOSetup(4, 1)
	if s.partitionConcurrency != 16 || s.order != "key" {
		t.Errorf("the rows run %d jobs a partition, order %q; want the worker's defaults, 16 and key", s.partitionConcurrency, s.order)
	}
	if a := strings.Join(s.workerArgs(), " "); !strings.Contains(a, "--partition-concurrency 16 --order key") {
		t.Errorf("the default rows' worker arguments: %s", a)
	}
	s.partitionConcurrency = 1
	args := strings.Join(s.workerArgs(), " ")
	if !strings.Contains(args, "--work-time 50ms") || !strings.Contains(args, "--concurrency 100") || strings.Contains(args, "--partition-concurrency") {
		t.Errorf("one job a partition: %s", args)
	}
	s.partitionConcurrency = 16
	if a := s.workerArgs(); !slices.Contains(a, "--partition-concurrency") || !slices.Contains(a, "16") || !slices.Contains(a, "--order") || !slices.Contains(a, "key") {
		t.Errorf("16 a partition: %v", a)
	}
}

func TestIOJobs(t *testing.T) {
	t.Parallel()
	s := newIOSetup(4, 1)
	s.partitionConcurrency = 1
	if n := s.jobs(false); n != 400 {
		t.Errorf("4 in flight: %d jobs, want the floor of 400", n)
	}
	s.partitionConcurrency = 16 // 64 in flight: 1280 jobs/s, 3 s of them
	if n := s.jobs(false); n != 3840 {
		t.Errorf("64 in flight: %d jobs, want 3840", n)
	}
	if n := s.jobs(true); n%4 != 0 || n < 2*64 {
		t.Errorf("quick, 64 in flight: %d jobs", n)
	}
}
