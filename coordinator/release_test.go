package coordinator_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A lease Run handed out and its owner released (a worker gives a
// partition up when a handler hangs) leaves Run's holdings: Run takes the
// partition again, under a new epoch, instead of counting it as held.
func TestRunTakesAGivenUpPartitionAgain(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	leases := make(chan *coordinator.Lease, 4)
	c, err := coordinator.New(b, coordinator.Config{
		Worker: "a", Partitions: 1, TTL: 2 * time.Second,
		OnAcquire: func(l *coordinator.Lease) { leases <- l },
	})
	if err != nil {
		t.Fatal(err)
	}
	runGroup(t, context.Background(), c)
	next := func(what string) *coordinator.Lease {
		t.Helper()
		select {
		case l := <-leases:
			return l
		case <-time.After(time.Minute):
			t.Fatalf("gave up waiting for %s", what)
			return nil
		}
	}
	first := next("the first acquisition")
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	if err := first.Release(rctx); err != nil {
		t.Fatal(err)
	}
	second := next("Run to acquire the released partition again")
	if second.Epoch() <= first.Epoch() {
		t.Fatalf("epoch %d after %d", second.Epoch(), first.Epoch())
	}
	if held := c.Held(); len(held) != 1 || held[0] != second {
		t.Fatalf("Run holds %v", held)
	}
}

// A release that arrives while a renewal of the same lease is still being
// stored (a renewal whose request was cancelled, as a stopping worker's
// last write to its registration is) purges the record once that renewal
// lands. On a replicated bucket the server refuses a compare-and-set on a
// key with a write still in flight at once, with "wrong last sequence"
// (10164), and reading the key then shows the revision before it: a
// release that tried again at once gave up after its three tries within
// a millisecond or two and left the registration, and every partition it
// holds, to its TTL.
func TestReleaseWhileARenewalIsStillBeingStored(t *testing.T) {
	t.Parallel()
	cl := startCluster(t, natstest.SyncAlways())
	b := provision(t, cl.JetStream(t), 3)
	const rounds = 20
	failed := 0
	for i := range rounds {
		c, err := coordinator.New(b, coordinator.Config{Worker: fmt.Sprintf("w%d", i), Partitions: 1, TTL: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		ctx := ctxFor(t, time.Minute)
		l, err := c.RegisterSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.RewriteUnseen(); err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			failed++
			t.Errorf("round %d: release: %v", i, err)
			continue
		}
		snap, err := b.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(snap.Members, c.Worker()) {
			t.Errorf("round %d: the registration is still stored after its release: members %v", i, snap.Members)
		}
	}
	if failed > 0 {
		t.Logf("%d of %d releases failed", failed, rounds)
	}
}

// A commit that arrives while the previous commit of the same partition is
// still being stored (its answer lost) lands once that one has: on a
// replicated bucket the server refuses it at once with 10164 while the
// record still reads as before, and three tries back to back all failed.
func TestCommitWhileTheLastCommitIsStillBeingStored(t *testing.T) {
	t.Parallel()
	cl := startCluster(t, natstest.SyncAlways())
	b := provision(t, cl.JetStream(t), 3)
	c := newCoord(t, b, "a", 30*time.Second)
	ctx := ctxFor(t, time.Minute)
	l := acquireEventually(t, c, 0, 30*time.Second)
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	failed := 0
	for seq := uint64(2); seq <= 40; seq += 2 {
		if err := l.CommitUnseen(seq - 1); err != nil {
			t.Fatal(err)
		}
		if err := l.Commit(ctx, seq); err != nil {
			failed++
			t.Errorf("commit %d: %v", seq, err)
		}
	}
	if failed > 0 {
		t.Logf("%d of 20 commits failed", failed)
	}
}
