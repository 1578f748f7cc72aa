package wmsink_test

import (
	"context"
	"errors"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

func fenceMetadata(e leasehold.Epoch, key string, barrier bool) map[string]string {
	md := map[string]string{}
	leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: e, Acquisition: "a" + e.String(), Key: key, Worker: "w" + e.String()}.SetMetadata(md)
	if barrier {
		md[leasehold.HeaderBarrier] = "1"
	}
	return md
}

var fence3 = leasehold.FenceID{Scope: "orders", Partition: 3}

// While an admitted effect is being applied, State still shows the fence
// as it was: a reader that sees the new epoch can rely on its effect
// being applied. A reader that saw the raise first, and then a snapshot
// of the destination without the effect, saw the two in an order no
// sequence of calls explains.
func TestFenceRaisesAfterApply(t *testing.T) {
	t.Parallel()
	f := arrivalFencer(t, nil)
	ctx := context.Background()
	if err := f.Fence(ctx, fenceMetadata(4, "first", false), func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	var during leasehold.FenceState
	if err := f.Fence(ctx, fenceMetadata(6, "second", false), func() error {
		during = f.State(fence3)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if during.Epoch != 4 {
		t.Fatalf("State while epoch 6's effect was being applied = e%d, want e4: the fence showed an epoch whose effect was not applied yet", during.Epoch)
	}
	if st := f.State(fence3); st.Epoch != 6 || st.Acquisition != "a6" || st.Holder != "w6" {
		t.Fatalf("State after the effect was applied = %+v, want e6 of a6 held by w6", st)
	}
}

// A failed apply leaves the fence where it was, as a sink's failed
// transaction leaves its fence row: the epoch was not accepted, and an
// effect of the epoch below is still admitted.
func TestFailedApplyRaisesNothing(t *testing.T) {
	t.Parallel()
	var decisions []sink.Decision
	f := arrivalFencer(t, sink.ObserverFunc(func(_ context.Context, d sink.Decision) { decisions = append(decisions, d) }))
	ctx := context.Background()
	if err := f.Fence(ctx, fenceMetadata(4, "first", false), func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	blip := errors.New("database blip")
	if err := f.Fence(ctx, fenceMetadata(6, "second", false), func() error { return blip }); !errors.Is(err, blip) {
		t.Fatalf("Fence with a failing apply = %v, want the apply's error", err)
	}
	if st := f.State(fence3); st.Epoch != 4 {
		t.Fatalf("State after epoch 6's apply failed = e%d, want e4", st.Epoch)
	}
	applied := false
	if err := f.Fence(ctx, fenceMetadata(5, "third", false), func() error { applied = true; return nil }); err != nil || !applied {
		t.Fatalf("Fence(e5) after epoch 6 failed to apply = %v (applied %v), want it admitted", err, applied)
	}
	if n := f.Dropped(fence3); n != 0 {
		t.Fatalf("Dropped = %d, want 0", n)
	}
	if len(decisions) != 3 || decisions[1].Outcome != sink.Failed || decisions[2].Outcome != sink.Accepted {
		t.Fatalf("decisions %+v, want accepted, failed, accepted", decisions)
	}
}

// A barrier below the fence moves nothing and is no drop, and Fence says
// it is stale: a caller sending its own barrier learns in the same
// critical section whether its acquisition is still the newest, with no
// window between a check of State and the barrier.
func TestLateBarrierIsStale(t *testing.T) {
	t.Parallel()
	var decisions []sink.Decision
	f := arrivalFencer(t, sink.ObserverFunc(func(_ context.Context, d sink.Decision) { decisions = append(decisions, d) }))
	ctx := context.Background()
	if err := f.Fence(ctx, fenceMetadata(7, "barrier-7", true), nil); err != nil {
		t.Fatal(err)
	}
	err := f.Fence(ctx, fenceMetadata(5, "barrier-5", true), nil)
	var se *leasehold.StaleEpochError
	if !errors.As(err, &se) || !errors.Is(err, leasehold.ErrStaleEpoch) || se.Epoch != 5 || se.Max != 7 || se.SplitBrain {
		t.Fatalf("Fence(late barrier e5 after e7) = %v, want a stale-epoch error with epoch 5 and max 7", err)
	}
	if st := f.State(fence3); st.Epoch != 7 {
		t.Fatalf("State after the late barrier = e%d, want e7", st.Epoch)
	}
	if n := f.Dropped(fence3); n != 0 {
		t.Fatalf("Dropped = %d after a late barrier, want 0: it is no effect", n)
	}
	if len(decisions) != 1 || decisions[0].Outcome != sink.Advanced {
		t.Fatalf("decisions %+v, want the first barrier's Advanced only", decisions)
	}
}
