package sinktest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Verification by acquisition: a sink that verifies admits a new (fence,
// epoch, acquisition) only if the lease bucket issued that epoch to that
// fence with that token, as the fence record names it. These cases run
// against a real lease bucket, on one server and on a three-node cluster
// where they say so.

// leaseWorld is a lease bucket, its job stream (32 partitions) and a
// coordinator acquiring from it.
type leaseWorld struct {
	js     jetstream.JetStream
	bucket *coordinator.Bucket
	coord  *coordinator.Coordinator
}

func newLeaseWorld(ctx context.Context, t *testing.T, h *harness, topo string) *leaseWorld {
	t.Helper()
	var js jetstream.JetStream
	replicas := 1
	if topo == "cluster" {
		js, replicas = natstest.StartCluster(t).JetStream(t), 3
	} else {
		js = natstest.Start(t).JetStream(t)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "leases", Scope: h.scope, Replicas: replicas, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     h.scope + "-jobs",
		Subjects: []string{h.scope + ".jobs.>"},
		Replicas: replicas,
		Metadata: map[string]string{"leasehold.partitions": "32"},
	}); err != nil {
		t.Fatal(err)
	}
	coord, err := coordinator.New(bucket, coordinator.Config{Worker: "holder", TTL: 5 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	return &leaseWorld{js: js, bucket: bucket, coord: coord}
}

// topologies runs f once on a single server and once on a cluster, each
// with a harness (and so a sink) of its own.
func (h *harness) topologies(t *testing.T, f func(t *testing.T, h *harness, topo string)) {
	for _, topo := range []string{"single", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			f(t, h.fork(t), topo)
		})
	}
}

// fork is a fresh harness for subtest t.
func (h *harness) fork(t *testing.T) *harness {
	name := newName(t.Name())
	return &harness{t: t, f: h.f, rec: &recorder{}, newSink: h.newSink, name: name, scope: "jobs-" + name}
}

// forgedStamp is a stamp a writer made up: fence id, epoch e, acquisition
// a.
func (h *harness) forgedEffect(id leasehold.FenceID, e leasehold.Epoch, a, name string) sink.Effect {
	return sink.Effect{
		Stamp:   leasehold.Stamp{Scope: id.Scope, Partition: id.Partition, Epoch: e, Acquisition: a, Key: h.name + "." + name, Worker: "forger"},
		Subject: h.inst.Subject(name),
		Data:    []byte("data of " + name),
	}
}

// wantUnverified fails unless err refuses a write as unverified.
func wantUnverified(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Fatalf("%s = %v, want an error matching sink.ErrUnverifiedEpoch", what, err)
	}
}

// checkUnverified is wantUnverified that lets the case go on, to show
// what an admitted forgery does next.
func checkUnverified(t *testing.T, what string, err error) bool {
	t.Helper()
	if !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Errorf("%s = %v, want an error matching sink.ErrUnverifiedEpoch", what, err)
		return false
	}
	return true
}

// testOtherFence: an epoch the lease bucket issued to a lock of the same
// bucket, presented on a partition whose fence record never held it, is
// refused, and so is a partition's epoch presented on the lock. Partition
// 0 is held at A, the lock at L1, partition 0 again at B, the lock again
// at L2 (A < L1 < B < L2): L1 is below the highest epoch partition 0 was
// issued and B below the lock's, so a check against a high-water mark of
// issued epochs admits both.
func testOtherFence(t *testing.T, h *harness) {
	h.topologies(t, func(t *testing.T, h *harness, topo string) {
		ctx := caseCtx(t)
		w := newLeaseWorld(ctx, t, h, topo)
		const p = leasehold.Partition(0)
		la := acquire(ctx, t, w.coord, p)
		s := h.start(w.bucket)
		h.mustApply(ctx, s, h.stampedBy(la.Info(), "a-first"))

		l1, err := w.coord.TryLock(ctx, "report")
		if err != nil {
			t.Fatal(err)
		}
		lockInfo1 := l1.Info()
		if err := l1.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		lb := acquire(ctx, t, w.coord, p)
		defer func() { _ = lb.Release(context.WithoutCancel(ctx)) }()
		l2, err := w.coord.TryLock(ctx, "report")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = l2.Release(context.WithoutCancel(ctx)) }()
		A, L1, B, L2 := la.Epoch(), lockInfo1.Epoch, lb.Epoch(), l2.Epoch()
		if !(A < L1 && L1 < B && B < L2) {
			t.Fatalf("epochs A=%d L1=%d B=%d L2=%d are not in the order the case needs", A, L1, B, L2)
		}

		// The lock's epoch, with the lock's own token, on partition 0.
		onPartition := h.forgedEffect(la.Info().Fence(), L1, lockInfo1.Acquisition, "lock-epoch-on-partition")
		wantUnverified(t, fmt.Sprintf("Apply(partition 0 stamped with the lock's epoch %d, between its epochs %d and %d)", L1, A, B), s.Apply(ctx, onPartition))
		h.wantMax(ctx, s, p, A)
		// The former holder of A is not fenced out by it: its effects
		// (committed, for a sink that reads a log) still apply until B's
		// arrive.
		aLater := h.stampedBy(la.Info(), "a-later")
		h.mustApply(ctx, s, aLater)
		bFirst := h.stampedBy(lb.Info(), "b-first")
		h.mustApply(ctx, s, bFirst)
		h.wantMax(ctx, s, p, B)

		// Partition 0's epoch B, with B's token, on the lock.
		onLock := h.forgedEffect(lockInfo1.Fence(), B, lb.Info().Acquisition, "partition-epoch-on-lock")
		wantUnverified(t, fmt.Sprintf("Apply(lock stamped with partition 0's epoch %d, between its epochs %d and %d)", B, L1, L2), s.Apply(ctx, onLock))
		h.wantMaxIn(ctx, s, lockInfo1.Scope, 0, 0)
		lockFirst := h.stampedBy(lockInfo1, "l1-write")
		h.mustApply(ctx, s, lockFirst)
		lockNext := h.stampedBy(l2.Info(), "l2-write")
		h.mustApply(ctx, s, lockNext)
		h.wantMaxIn(ctx, s, lockInfo1.Scope, 0, L2)
		h.wantApplied(ctx, []sink.Effect{aLater, bFirst, lockFirst, lockNext}, []sink.Effect{onPartition, onLock})
		if n := len(h.rec.find(onPartition, sink.Unverified)) + len(h.rec.find(onLock, sink.Unverified)); n != 2 {
			t.Fatalf("the observer saw %d Unverified decisions for the two misplaced epochs, want 2", n)
		}
	})
}

// testForgedAcquisition: the live holder's epoch, which anyone who reads
// the lease bucket knows, with an acquisition the holder does not have, is
// refused before the holder's first write, as an effect and as an Advance
// (a barrier): it cannot fence the holder out. The holder's writes then
// apply and the forger's stay refused.
func testForgedAcquisition(t *testing.T, h *harness) {
	h.topologies(t, func(t *testing.T, h *harness, topo string) {
		ctx := caseCtx(t)
		w := newLeaseWorld(ctx, t, h, topo)
		s := h.start(w.bucket)

		// An effect, before the holder's first.
		l := acquire(ctx, t, w.coord, 1)
		defer func() { _ = l.Release(context.WithoutCancel(ctx)) }()
		forged := h.forgedEffect(l.Info().Fence(), l.Epoch(), "forged", "forged-effect")
		if checkUnverified(t, fmt.Sprintf("Apply(the holder's epoch %d with a forged acquisition)", l.Epoch()), s.Apply(ctx, forged)) {
			h.wantMax(ctx, s, 1, 0)
		}
		first, second := h.stampedBy(l.Info(), "holder-first"), h.stampedBy(l.Info(), "holder-second")
		h.mustApply(ctx, s, first)
		h.mustApply(ctx, s, second)
		if err := s.Apply(ctx, h.forgedEffect(l.Info().Fence(), l.Epoch(), "forged", "forged-after")); err == nil {
			t.Fatal("the forged acquisition was admitted after the holder's writes")
		}

		// An Advance (the barrier a worker writes on acquisition), between
		// the acquisition and the holder's own.
		l2 := acquire(ctx, t, w.coord, 2)
		defer func() { _ = l2.Release(context.WithoutCancel(ctx)) }()
		forgedLease := l2.Info()
		forgedLease.Acquisition, forgedLease.Holder = "forged", "forger"
		if checkUnverified(t, fmt.Sprintf("Advance(the holder's epoch %d with a forged acquisition)", l2.Epoch()), s.Advance(ctx, forgedLease)) {
			h.wantMax(ctx, s, 2, 0)
		}
		if err := s.Advance(ctx, l2.Info()); err != nil {
			t.Fatalf("the holder's own Advance after a forged one: %v", err)
		}
		third := h.stampedBy(l2.Info(), "holder-third")
		h.mustApply(ctx, s, third)
		f, err := s.Fence(ctx, l2.Info().Fence())
		if err != nil {
			t.Fatal(err)
		}
		if f.Epoch != l2.Epoch() || f.Acquisition != l2.Info().Acquisition {
			t.Fatalf("fence of partition 2 = %+v, want the holder's epoch %d and acquisition %s", f, l2.Epoch(), l2.Info().Acquisition)
		}
		h.wantApplied(ctx, []sink.Effect{first, second, third}, []sink.Effect{forged})
	})
}

// testFarBehind: a legitimate former holder's effect reaches a sink that
// has seen nothing since, after the partition changed hands as often as
// the fence record remembers: it is still admitted, so no committed effect
// is refused. One acquisition more and the record has forgotten it: it is
// refused as unverified, and the refusal says it was forgotten.
func testFarBehind(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	w := newLeaseWorld(ctx, t, h, "single")
	s := h.start(w.bucket)
	cycle := func(p leasehold.Partition, n int) {
		t.Helper()
		for range n {
			l := acquire(ctx, t, w.coord, p)
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	first := acquire(ctx, t, w.coord, 3)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	cycle(3, coordinator.FenceHistory-1)
	behind := h.stampedBy(first.Info(), "far-behind")
	h.mustApply(ctx, s, behind)
	h.wantMax(ctx, s, 3, first.Epoch())

	gone := acquire(ctx, t, w.coord, 4)
	if err := gone.Release(ctx); err != nil {
		t.Fatal(err)
	}
	cycle(4, coordinator.FenceHistory)
	forgotten := h.stampedBy(gone.Info(), "forgotten")
	err := s.Apply(ctx, forgotten)
	wantUnverified(t, fmt.Sprintf("Apply(an acquisition %d acquisitions behind)", coordinator.FenceHistory), err)
	if !errors.Is(err, sink.ErrForgottenEpoch) || !strings.Contains(err.Error(), "remembers") {
		t.Fatalf("refusal of a forgotten acquisition %q does not match sink.ErrForgottenEpoch and say so", err)
	}
	h.wantApplied(ctx, []sink.Effect{behind}, []sink.Effect{forgotten})
}

// testPreviousRecord: a fence record written by the release before
// acquisitions were recorded in its history (epochs only) still verifies
// those epochs, by epoch; its current acquisition is verified by token.
func testPreviousRecord(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	w := newLeaseWorld(ctx, t, h, "single")
	const p = leasehold.Partition(5)
	old := acquire(ctx, t, w.coord, p)
	if err := old.Release(ctx); err != nil {
		t.Fatal(err)
	}
	cur := acquire(ctx, t, w.coord, p)
	defer func() { _ = cur.Release(context.WithoutCancel(ctx)) }()
	key := fmt.Sprintf("partition.%d", p)
	fences := w.bucket.FenceRecords()
	e, err := fences.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	prev, _ := json.Marshal(map[string]any{
		"epoch": uint64(cur.Epoch()), "acquisition": cur.Info().Acquisition, "holder": "holder",
		"recent": []uint64{uint64(old.Epoch()), uint64(cur.Epoch())},
	})
	if _, err := fences.Update(ctx, key, prev, e.Revision()); err != nil {
		t.Fatal(err)
	}
	s := h.start(w.bucket)
	before := h.stampedBy(old.Info(), "previous-holder")
	h.mustApply(ctx, s, before)
	forged := h.forgedEffect(cur.Info().Fence(), cur.Epoch(), "forged", "forged-current")
	wantUnverified(t, "Apply(the current epoch of a previous-release record with a forged acquisition)", s.Apply(ctx, forged))
	now := h.stampedBy(cur.Info(), "current-holder")
	h.mustApply(ctx, s, now)
	h.wantMax(ctx, s, p, cur.Epoch())
	h.wantApplied(ctx, []sink.Effect{before, now}, []sink.Effect{forged})
}
