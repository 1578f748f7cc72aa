package worker

import (
	"testing"

	"github.com/leasehold/leasehold"
)

// An enqueue's options cost it nothing of their own when none are given:
// the ID is the one allocation, and a keyed enqueue adds its order key's.
// A caller's WithOrderKey still replaces the key's own.
func TestEnqueueOptionsAllocations(t *testing.T) {
	key := []byte("customer-42")
	if o := enqueueOptionsKeyed(key, nil); o.order != leasehold.OrderKey(key) || o.id == "" {
		t.Fatalf("keyed, no options: order %q, id %q; want the key's order key and an ID", o.order, o.id)
	}
	other := []byte("tenant-7")
	if o := enqueueOptionsKeyed(key, []EnqueueOption{WithOrderKey(other), JobID("j1")}); o.order != leasehold.OrderKey(other) || o.id != "j1" {
		t.Fatalf("keyed, WithOrderKey and JobID given: order %q, id %q; want tenant-7's order key and j1", o.order, o.id)
	}
	if o := enqueueOptions(nil); o.order != "" || o.id == "" {
		t.Fatalf("no key, no options: order %q, id %q; want none and an ID", o.order, o.id)
	}
	plain := testing.AllocsPerRun(200, func() { _ = enqueueOptions(nil) })
	keyed := testing.AllocsPerRun(200, func() { _ = enqueueOptionsKeyed(key, nil) })
	if plain > 1 || keyed > 2 {
		t.Errorf("allocations: %.1f without a key, %.1f with one; want 1 (the ID) and 2 (and the order key)", plain, keyed)
	}
}

// A producer names a partition's subject without building it, for the
// partition counts it keeps them for, and as JobSubject does for all.
func TestProducerSubjects(t *testing.T) {
	for _, n := range []int{1, 16, subjectsKept, subjectsKept + 1} {
		p := &Producer{cfg: ProducerConfig{Prefix: "orders", Partitions: n}, subjects: keptSubjects("orders", n)}
		if kept := len(p.subjects) == n; kept != (n <= subjectsKept) {
			t.Fatalf("%d partitions: subjects kept %v, want %v", n, kept, n <= subjectsKept)
		}
		for _, part := range []leasehold.Partition{0, leasehold.Partition(n - 1)} {
			if got, want := p.subject(part), JobSubject("orders", part); got != want {
				t.Fatalf("%d partitions: subject(%d) = %q, want %q", n, part, got, want)
			}
		}
	}
}
