package coordinator_test

import (
	"errors"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A storage rollback hands one revision to two acquisitions: acquire
// (epoch E, acquisition A1), stop the server, restore its store as it was
// before, start it, acquire again: epoch E once more, acquisition A2. The
// two leases differ in Acquisition, and a sink that admitted A1's write
// refuses A2's as a split brain.
func TestStorageRollbackGivesOneEpochTwice(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, 60*time.Second)
	b := provision(t, srv.JetStream(t), 1)
	const p = leasehold.Partition(3)

	srv.Shutdown()
	before := srv.Snapshot(t)
	srv.Restart(t)
	b, err := coordinator.OpenBucket(ctx, srv.JetStream(t), b.Name())
	if err != nil {
		t.Fatal(err)
	}
	l1, err := newCoord(t, b, "a", 10*time.Second).Acquire(ctx, p, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	first := l1.Info()
	s := sink.NewMemory(sink.MemoryConfig{})
	if err := s.Advance(ctx, first); err != nil {
		t.Fatal(err)
	}
	if err := s.Apply(ctx, sink.Effect{Stamp: first.Stamp("k1"), Subject: "x", Data: []byte("a1")}); err != nil {
		t.Fatal(err)
	}

	srv.Shutdown()
	srv.Restore(t, before)
	srv.Restart(t)
	b, err = coordinator.OpenBucket(ctx, srv.JetStream(t), b.Name())
	if err != nil {
		t.Fatal(err)
	}
	l2, err := newCoord(t, b, "b", 10*time.Second).Acquire(ctx, p, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	second := l2.Info()
	if second.Epoch != first.Epoch || second.Acquisition == first.Acquisition {
		t.Fatalf("after the rollback: epoch %d acquisition %s; before: %d, %s (want one epoch, two acquisitions)",
			second.Epoch, second.Acquisition, first.Epoch, first.Acquisition)
	}
	err = s.Apply(ctx, sink.Effect{Stamp: second.Stamp("k2"), Subject: "x", Data: []byte("a2")})
	if !errors.Is(err, leasehold.ErrSplitBrain) || !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("A2's write after A1's: %v, want a split-brain refusal", err)
	}
	if err := s.Advance(ctx, second); !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("Advance of A2 over A1: %v, want a split-brain refusal", err)
	}
	if e, _ := s.Get("x"); string(e.Data) != "a1" {
		t.Fatalf("the sink holds %q", e.Data)
	}
	_ = l1.Release(ctx) // its server state is gone: refused or not, it does not matter
	_ = l2.Release(ctx)
}
