package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

func TestAcquireHeldRelease(t *testing.T) {
	t.Parallel()
	js, b := startBucket(t)
	a, bw := newCoord(t, b, "a", 2*time.Second), newCoord(t, b, "b", 2*time.Second)
	ctx := ctxFor(t, 10*time.Second)

	la, err := a.Acquire(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	// The epoch is the revision of the acquiring write.
	kv, _ := js.KeyValue(ctx, b.Name())
	if e, err := kv.Get(ctx, "partition.3"); err != nil || e.Revision() != uint64(la.Epoch()) {
		t.Fatalf("epoch %d, key revision %v (%v)", la.Epoch(), e, err)
	}
	_, err = bw.Acquire(ctx, 3)
	var held *coordinator.HeldError
	if !errors.As(err, &held) || held.Lease.Holder != "a" || held.Lease.Epoch != la.Epoch() {
		t.Fatalf("second acquire: %v, want HeldError naming a at epoch %d", err, la.Epoch())
	}
	// Renewals keep the epoch and outlive the TTL.
	time.Sleep(3 * time.Second)
	if la.Err() != nil {
		t.Fatalf("lease lapsed while renewing itself: %v", la.Err())
	}
	if _, err := bw.Acquire(ctx, 3); !errors.Is(err, coordinator.ErrHeld) {
		t.Fatalf("acquire of a renewed lease: %v", err)
	}
	// Release hands over at once, with a higher epoch.
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := la.Release(ctx); err != nil {
		t.Fatalf("second release: %v", err)
	}
	if !errors.Is(context.Cause(la.Context()), coordinator.ErrReleased) {
		t.Fatalf("cause after release: %v", context.Cause(la.Context()))
	}
	lb, err := bw.Acquire(ctx, 3)
	if err != nil {
		t.Fatalf("acquire after release: %v", err)
	}
	defer lb.Release(ctx)
	if lb.Epoch() <= la.Epoch() {
		t.Fatalf("epoch went from %d to %d", la.Epoch(), lb.Epoch())
	}
}

// The stale holder: A's renewals are held back, A's lease expires on the
// server, B takes the partition; A's renew, release and progress commit all
// fail with ErrLeaseLost, and A's context says so.
func TestStaleHolder(t *testing.T) {
	t.Parallel()
	onEachTopology(t, func(t *testing.T, js jetstream.JetStream, replicas int) {
		b := provision(t, js, replicas)
		// A's TTL is the wait the test is about, so it is the shortest the
		// server takes. B only has to keep its lease while it commits: a
		// 1 s TTL on a loaded machine lapsed before its renewals landed.
		a, bw := newCoord(t, b, "a", time.Second), newCoord(t, b, "b", 10*time.Second)
		ctx := ctxFor(t, 30*time.Second)

		la, err := a.Acquire(ctx, 0, coordinator.ManualRenew())
		if err != nil {
			t.Fatal(err)
		}
		if err := la.Commit(ctx, 10); err != nil {
			t.Fatal(err)
		}
		select {
		case <-la.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("A's context outlived its local deadline")
		}
		var lost *coordinator.LostError
		if cause := context.Cause(la.Context()); !errors.Is(cause, leasehold.ErrLeaseLost) || !errors.As(cause, &lost) || lost.Reason != coordinator.LostDeadline {
			t.Fatalf("cause %v, want a deadline LostError", cause)
		}
		if time.Now().Before(la.Deadline()) {
			t.Fatal("cancelled before the deadline")
		}

		lb := acquireEventually(t, bw, 0, 10*time.Second)
		defer lb.Release(ctx)
		if lb.Epoch() <= la.Epoch() {
			t.Fatalf("successor epoch %d is not above %d", lb.Epoch(), la.Epoch())
		}
		if lb.Progress() != 10 {
			t.Fatalf("successor resumes after %d, want 10", lb.Progress())
		}
		if err := la.Renew(ctx); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Fatalf("stale renew: %v", err)
		}
		if err := la.Release(ctx); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Fatalf("stale release: %v", err)
		}
		if err := la.Commit(ctx, 20); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Fatalf("stale commit: %v", err)
		}
		if err := lb.Commit(ctx, 11); err != nil {
			t.Fatalf("successor commit: %v", err)
		}
		if lb.Err() != nil {
			t.Fatalf("successor lease: %v", lb.Err())
		}
	})
}

// A renewal refused by the server (the partition was fenced by an operator
// while A still believed it held it) loses the lease at once.
func TestRefusedRenew(t *testing.T) {
	t.Parallel()
	js, b := startBucket(t)
	a, op := newCoord(t, b, "a", 5*time.Second), newCoord(t, b, "operator", 5*time.Second)
	ctx := ctxFor(t, 20*time.Second)
	la, err := a.Acquire(ctx, 1, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	kv, _ := js.KeyValue(ctx, b.Name())
	if err := kv.Purge(ctx, "partition.1"); err != nil {
		t.Fatal(err)
	}
	lo, err := op.Acquire(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer lo.Release(ctx)
	err = la.Renew(ctx)
	var lost *coordinator.LostError
	if !errors.As(err, &lost) || lost.Reason != coordinator.LostRefused || lost.Holder != "operator" {
		t.Fatalf("renew: %v, want a refused LostError naming the operator", err)
	}
	select {
	case <-la.Done():
	default:
		t.Fatal("context not cancelled after a refused renewal")
	}
	if err := la.Commit(ctx, 5); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("commit after fence: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	bad := []coordinator.Config{
		{Worker: "has space"},
		{Worker: "w", TTL: 1500 * time.Millisecond},
		{Worker: "w", TTL: 500 * time.Millisecond},
		{Worker: "w", TTL: 3 * time.Second, RenewEvery: 2 * time.Second},
		{Worker: "w", TTL: 3 * time.Second, Margin: 3 * time.Second},
		{Worker: "w", Partitions: -1},
	}
	for _, c := range bad {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v: want an error", c)
		}
	}
	if err := (coordinator.Config{Worker: "w-1_a", Partitions: 16}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (coordinator.Config{}).Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
}

func TestSnapshot(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	ctx := ctxFor(t, 10*time.Second)
	a := newCoord(t, b, "a", 5*time.Second)
	l, err := a.Acquire(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if err := l.Commit(ctx, 41); err != nil {
		t.Fatal(err)
	}
	l7, err := a.Acquire(ctx, 7)
	if err != nil {
		t.Fatal(err)
	}
	if err := l7.Release(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Partitions) != 2 {
		t.Fatalf("partitions %+v", st.Partitions)
	}
	p2, p7 := st.Partitions[0], st.Partitions[1]
	if p2.Partition != 2 || p2.Holder != "a" || p2.Epoch != l.Epoch() || p2.Progress != 41 || p2.FencedEpoch != l.Epoch() || p2.TTL != 5*time.Second {
		t.Fatalf("partition 2: %+v", p2)
	}
	if p7.Partition != 7 || p7.Holder != "" || p7.FencedEpoch != l7.Epoch() {
		t.Fatalf("partition 7 after release: %+v", p7)
	}
}

// Fence takes a live lease away from its holder: the holder's renewal and
// commit are refused, and the partition gets a higher epoch.
func TestFenceRemovesALiveLease(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	ctx := ctxFor(t, 10*time.Second)
	a := newCoord(t, b, "a", 10*time.Second)
	la, err := a.Acquire(ctx, 3, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	res, err := newCoord(t, b, "operator", 10*time.Second).Fence(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	if res.Previous.Holder != "a" || res.Previous.Epoch != la.Epoch() || res.Epoch <= la.Epoch() {
		t.Fatalf("fence result %+v for a lease at %d", res, la.Epoch())
	}
	if err := la.Renew(ctx); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("renew after fence: %v", err)
	}
	if err := la.Commit(ctx, 9); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("commit after fence: %v", err)
	}
	if e, err := b.FencedEpoch(ctx, 3); err != nil || e != res.Epoch {
		t.Fatalf("fenced epoch %d, %v; want %d", e, err, res.Epoch)
	}
	// A free partition is fenced too.
	if res, err := newCoord(t, b, "operator", 10*time.Second).Fence(ctx, 4); err != nil || res.Previous.Holder != "" {
		t.Fatalf("fence of a free partition: %+v, %v", res, err)
	}
}

// Acquire fences the partition's record whatever it holds: no record, a
// record of an earlier epoch (resumed from), a deleted record (a marker,
// which the first, optimistic write does not expect), a garbled
// record (refused with what to fix) and a record fenced at a later epoch
// than the acquisition (the acquisition is lost, not the later one). The
// first two land with the optimistic write against a direct get of the
// record; the others fall back to reading through the stream leader.
func TestAcquireFencesProgressWhateverTheRecordHolds(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	c := newCoord(t, b, "a", 2*time.Second)
	ctx := ctxFor(t, 20*time.Second)
	kv := b.FenceRecords()

	fenced := func(t *testing.T, p leasehold.Partition, want uint64) {
		t.Helper()
		l, err := c.Acquire(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		if l.Progress() != want {
			t.Errorf("resumes after %d, want %d", l.Progress(), want)
		}
		e, err := kv.Get(ctx, fmt.Sprintf("partition.%d", p))
		if err != nil {
			t.Fatal(err)
		}
		var rec struct {
			Epoch       uint64   `json:"epoch"`
			Acquisition string   `json:"acquisition"`
			Seq         uint64   `json:"seq"`
			Holder      string   `json:"holder"`
			Recent      []uint64 `json:"recent"`
		}
		if err := json.Unmarshal(e.Value(), &rec); err != nil {
			t.Fatal(err)
		}
		info := l.Info()
		if rec.Epoch != uint64(info.Epoch) || rec.Acquisition != info.Acquisition || rec.Seq != want || rec.Holder != "a" || rec.Recent[len(rec.Recent)-1] != rec.Epoch {
			t.Errorf("fence record %s, want epoch %d, acquisition %s, seq %d", e.Value(), info.Epoch, info.Acquisition, want)
		}
		if err := l.Commit(ctx, want+1); err != nil {
			t.Errorf("commit after the fence: %v", err)
		}
	}
	t.Run("none", func(t *testing.T) { fenced(t, 1, 0) })
	t.Run("earlier epoch", func(t *testing.T) {
		if _, err := kv.Put(ctx, "partition.2", []byte(`{"epoch":1,"seq":42,"holder":"old"}`)); err != nil {
			t.Fatal(err)
		}
		fenced(t, 2, 42)
	})
	t.Run("purged", func(t *testing.T) {
		if _, err := kv.Put(ctx, "partition.3", []byte(`{"epoch":1,"seq":7,"holder":"old"}`)); err != nil {
			t.Fatal(err)
		}
		if err := kv.Delete(ctx, "partition.3"); err != nil {
			t.Fatal(err)
		}
		fenced(t, 3, 0)
	})
	t.Run("garbled", func(t *testing.T) {
		if _, err := kv.Put(ctx, "partition.4", []byte(`seq=9`)); err != nil {
			t.Fatal(err)
		}
		_, err := c.Acquire(ctx, 4)
		if err == nil || !strings.Contains(err.Error(), "partition.4") {
			t.Fatalf("acquire over a garbled progress record: %v, want an error naming the key", err)
		}
		if _, err := c.Acquire(ctx, 4); err == nil || errors.Is(err, coordinator.ErrHeld) {
			t.Fatalf("second acquire: %v; the failed one must release the lease and fail again on the record", err)
		}
	})
	t.Run("later epoch", func(t *testing.T) {
		if _, err := kv.Put(ctx, "partition.5", []byte(`{"epoch":9000000000000000000,"seq":5,"holder":"later"}`)); err != nil {
			t.Fatal(err)
		}
		_, err := c.Acquire(ctx, 5)
		if !errors.Is(err, leasehold.ErrLeaseLost) || !strings.Contains(err.Error(), "9000000000000000000") {
			t.Fatalf("acquire under a later fence: %v, want a lost lease naming the later epoch", err)
		}
		e, err := kv.Get(ctx, "partition.5")
		if err != nil || !strings.Contains(string(e.Value()), `"holder":"later"`) {
			t.Fatalf("the later fence was overwritten: %s (%v)", e.Value(), err)
		}
	})
}
