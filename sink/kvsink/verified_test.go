package kvsink_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A fence that recorded no acquisition at its epoch (written before fences
// kept acquisitions) is raised by the first acquisition seen at that
// epoch, which every other at that epoch is then refused for: that raise
// is verified like any other. The live holder's epoch with a forged
// acquisition is refused, and the holder's own raises the fence and
// applies.
func TestEqualEpochRaiseIsVerified(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "orders-jobs", Subjects: []string{"orders.jobs.>"},
		Metadata: map[string]string{"leasehold.partitions": "4"}}); err != nil {
		t.Fatal(err)
	}
	c, err := coordinator.New(bucket, coordinator.Config{Worker: "holder", TTL: 5 * time.Second, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.Acquire(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(context.WithoutCancel(ctx))
	s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "orders-out", Verifier: bucket, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	out, err := js.KeyValue(ctx, "orders-out")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := out.Put(ctx, "_leasehold.fence.orders.1", fmt.Appendf(nil, `{"epoch":%d,"holder":"old"}`, l.Epoch())); err != nil {
		t.Fatal(err)
	}
	forged := sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: l.Epoch(), Acquisition: "forged", Key: "forged", Worker: "forger"}, Subject: "forged", Data: []byte("f")}
	if err := s.Apply(ctx, forged); !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Fatalf("Apply(the fence's epoch with a forged acquisition, over a fence with none) = %v, want an error matching sink.ErrUnverifiedEpoch", err)
	}
	holder := sink.Effect{Stamp: l.Info().Stamp("holder"), Subject: "holder", Data: []byte("h")}
	if err := s.Apply(ctx, holder); err != nil {
		t.Fatalf("the holder's write after a forged one: %v", err)
	}
	if f, err := s.Fence(ctx, l.Info().Fence()); err != nil || f.Epoch != l.Epoch() || f.Acquisition != l.Info().Acquisition {
		t.Fatalf("fence %+v, %v; want the holder's epoch %d and acquisition", f, err, l.Epoch())
	}
	if _, err := out.Get(ctx, "forged"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("the forged effect was applied: %v", err)
	}
	// Advance takes the same path.
	l2, err := c.Acquire(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(context.WithoutCancel(ctx))
	if _, err := out.Put(ctx, "_leasehold.fence.orders.2", fmt.Appendf(nil, `{"epoch":%d,"holder":"old"}`, l2.Epoch())); err != nil {
		t.Fatal(err)
	}
	bad := l2.Info()
	bad.Acquisition = "forged"
	if err := s.Advance(ctx, bad); !errors.Is(err, sink.ErrUnverifiedEpoch) {
		t.Fatalf("Advance(the fence's epoch with a forged acquisition) = %v, want an error matching sink.ErrUnverifiedEpoch", err)
	}
	if err := s.Advance(ctx, l2.Info()); err != nil {
		t.Fatalf("the holder's Advance: %v", err)
	}
}
