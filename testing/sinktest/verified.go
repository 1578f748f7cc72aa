package sinktest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// testForged runs a real lease bucket on an embedded server, acquires a
// partition, and checks that an epoch the bucket never issued cannot raise
// the partition's maximum, while the legitimate holder keeps writing.
func testForged(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "leases", Scope: "jobs-" + h.name, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// The lease bucket verifies partitions of its job stream only.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     "jobs-" + h.name + "-jobs",
		Subjects: []string{"jobs-" + h.name + ".jobs.>"},
		Metadata: map[string]string{"leasehold.partitions": "32"},
	}); err != nil {
		t.Fatal(err)
	}
	coord, err := coordinator.New(bucket, coordinator.Config{Worker: "holder", TTL: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	const p = leasehold.Partition(17)
	lease := acquire(ctx, t, coord, p)
	epoch := lease.Epoch()

	s := h.start(bucket)
	legit := h.stampedBy(lease.Info(), "legit")
	h.mustApply(ctx, s, legit)

	forged := h.stampedBy(lease.Info(), "forged")
	forged.Stamp.Epoch += 1_000_000
	err = s.Apply(ctx, forged)
	if !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Fatalf("Apply(forged epoch %d above the fenced %d) = %v, want an error matching sink.ErrUnverifiedEpoch", forged.Stamp.Epoch, epoch, err)
	}
	var ue *sink.UnverifiedEpochError
	if !errors.As(err, &ue) || ue.Fenced != epoch || ue.Epoch != forged.Stamp.Epoch {
		t.Fatalf("error %v does not carry the forged and the fenced epoch", err)
	}
	h.wantMax(ctx, s, p, epoch)
	forgedLease := lease.Info()
	forgedLease.Epoch = leasehold.MaxEpoch
	if err := s.Advance(ctx, forgedLease); !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Fatalf("Advance(forged MaxEpoch) = %v, want an error matching sink.ErrUnverifiedEpoch", err)
	}
	h.wantMax(ctx, s, p, epoch)
	// The legitimate holder is not fenced out.
	again := h.stampedBy(lease.Info(), "legit-again")
	h.mustApply(ctx, s, again)
	if len(h.rec.find(forged, sink.Unverified)) != 1 {
		t.Fatalf("the observer saw no Unverified decision for the forged effect")
	}

	// A later acquisition's epoch is above the cached fenced epoch: the
	// sink must ask the bucket again and accept it.
	if err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	next := acquire(ctx, t, coord, p)
	defer func() { _ = next.Release(context.WithoutCancel(ctx)) }()
	if next.Epoch() <= epoch {
		t.Fatalf("re-acquisition epoch %d is not above %d", next.Epoch(), epoch)
	}
	successor := h.stampedBy(next.Info(), "successor")
	h.mustApply(ctx, s, successor)
	h.wantMax(ctx, s, p, next.Epoch())
	h.wantApplied(ctx, []sink.Effect{legit, again, successor}, []sink.Effect{forged})

	// A partition the job stream does not have is refused as unverified,
	// not retried, and creates no fence.
	outside := h.stampedBy(next.Info(), "outside")
	outside.Stamp.Partition = 9999
	if err := s.Apply(ctx, outside); !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Fatalf("Apply(partition 9999 of a 32-partition stream) = %v, want an error matching sink.ErrUnverifiedEpoch", err)
	}
}

// stampedBy builds an effect named name written under lease l.
func (h *harness) stampedBy(l leasehold.Lease, name string) sink.Effect {
	return sink.Effect{Stamp: l.Stamp(h.name + "." + name), Subject: h.inst.Subject(name), Data: []byte("data of " + name)}
}

func acquire(ctx context.Context, t *testing.T, c *coordinator.Coordinator, p leasehold.Partition) *coordinator.Lease {
	t.Helper()
	for {
		l, err := c.Acquire(ctx, p)
		if err == nil {
			return l
		}
		if !errors.Is(err, coordinator.ErrHeld) {
			t.Fatalf("acquire partition %d: %v", p, err)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("partition %d still held: %v", p, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
