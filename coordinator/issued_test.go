package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

const maxInt64 = "9223372036854775807"

// issued asks b for the issued epoch of partition p of its scope.
func issued(t *testing.T, ctx context.Context, b *coordinator.Bucket, p leasehold.Partition) leasehold.Epoch {
	t.Helper()
	e, err := b.IssuedEpoch(ctx, leasehold.FenceID{Scope: b.Scope(), Partition: p})
	if err != nil {
		t.Fatalf("IssuedEpoch(%d): %v", p, err)
	}
	return e
}

// IssuedEpoch answers from the lease key's server-assigned revisions: a
// fence record, a legacy progress record or a lease record without a TTL
// claiming MaxInt64, and garbage over the lease key, leave it at the
// epoch the bucket really issued, on one node and on the cluster.
func TestIssuedEpochIgnoresForgedRecords(t *testing.T) {
	t.Parallel()
	onEachTopology(t, func(t *testing.T, js jetstream.JetStream, replicas int) {
		b := provisionWithJobs(t, js, replicas, 8, 0)
		ctx := ctxFor(t, 30*time.Second)
		c := newCoord(t, b, "a", 5*time.Second)
		leases, fences := b.KeyValue(), b.FenceRecords()

		if got := issued(t, ctx, b, 1); got != 0 {
			t.Fatalf("never acquired: %d", got)
		}
		l, err := c.Acquire(ctx, 1)
		if err != nil {
			t.Fatal(err)
		}
		truth := l.Epoch()
		if got := issued(t, ctx, b, 1); got != truth {
			t.Fatalf("held: %d, want %d", got, truth)
		}
		// Forged while the lease is live: the live record answers.
		if _, err := fences.Put(ctx, "partition.1", []byte(`{"epoch":`+maxInt64+`,"holder":"forger","recent":[`+maxInt64+`]}`)); err != nil {
			t.Fatal(err)
		}
		if _, err := leases.Put(ctx, "progress.1", []byte(`{"epoch":`+maxInt64+`,"seq":1,"holder":"forger"}`)); err != nil {
			t.Fatal(err)
		}
		if got := issued(t, ctx, b, 1); got != truth {
			t.Fatalf("held, with forged records: %d, want %d", got, truth)
		}
		// Released: the marker bounds the fence record, which names
		// the truth among forged epochs.
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := fences.Put(ctx, "partition.1", []byte(fmt.Sprintf(`{"epoch":%s,"holder":"forger","recent":[%d,%s]}`, maxInt64, truth, maxInt64))); err != nil {
			t.Fatal(err)
		}
		if got := issued(t, ctx, b, 1); got != truth {
			t.Fatalf("released, with a forged fence record: %d, want %d", got, truth)
		}
		// A lease record without a TTL claiming MaxInt64 is not a lease:
		// its revision bounds the answer.
		if _, err := leases.Put(ctx, "partition.1", []byte(`{"holder":"forger","token":"t","epoch":`+maxInt64+`,"ttl_ms":5000}`)); err != nil {
			t.Fatal(err)
		}
		if got := issued(t, ctx, b, 1); got != truth {
			t.Fatalf("a lease record without a TTL: %d, want %d", got, truth)
		}
		// Nor is garbage.
		if _, err := leases.Put(ctx, "partition.1", []byte("garbage")); err != nil {
			t.Fatal(err)
		}
		if got := issued(t, ctx, b, 1); got != truth {
			t.Fatalf("garbage in the lease key: %d, want %d", got, truth)
		}
		// A fence record that forgets the truth answers less, never more.
		if _, err := fences.Put(ctx, "partition.1", []byte(`{"epoch":`+maxInt64+`,"holder":"forger"}`)); err != nil {
			t.Fatal(err)
		}
		if got := issued(t, ctx, b, 1); got > truth {
			t.Fatalf("a fence record with nothing but MaxInt64: %d, above %d", got, truth)
		}

		// A well-formed lease with its TTL is a stolen lease: a real
		// acquisition, whose revision is the answer.
		msg := nats.NewMsg("$KV." + b.Name() + ".partition.2")
		msg.Data = []byte(`{"holder":"thief","token":"t","epoch":` + maxInt64 + `,"ttl_ms":5000}`)
		ack, err := js.PublishMsg(ctx, msg, jetstream.WithMsgTTL(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if got := issued(t, ctx, b, 2); got != leasehold.Epoch(ack.Sequence) {
			t.Fatalf("a stolen lease: %d, want its revision %d", got, ack.Sequence)
		}
	})
}

// Fences the bucket does not serve are refused with a typed error a sink
// classifies as unverified: partitions beyond the job stream's count,
// other scopes, malformed lock names, a lock's partition other than 0, and
// any partition while there is no job stream (locks still answer).
func TestIssuedEpochUnknownFences(t *testing.T) {
	t.Parallel()
	js, b := startBucket(t)
	ctx := ctxFor(t, 20*time.Second)
	unknown := func(id leasehold.FenceID) {
		t.Helper()
		_, err := b.IssuedEpoch(ctx, id)
		var ue *coordinator.UnknownFenceError
		if !errors.As(err, &ue) || !errors.Is(err, coordinator.ErrUnknownFence) || !ue.Unverified() {
			t.Fatalf("IssuedEpoch(%v) = %v, want an UnknownFenceError", id, err)
		}
	}
	unknown(leasehold.FenceID{Scope: b.Scope(), Partition: 0}) // no job stream yet
	l, err := newCoord(t, b, "a", 5*time.Second).TryLock(ctx, "account:7")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if got, err := b.IssuedEpoch(ctx, l.Info().Fence()); err != nil || got != l.Epoch() {
		t.Fatalf("a lock without a job stream: %d, %v", got, err)
	}
	jobStream(t, js, b.Scope(), 8, 0)
	// A bucket keeps a missing job stream's verdict for a second; a new
	// one reads the stream at once.
	b, err = coordinator.OpenBucket(ctx, js, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if got := issued(t, ctx, b, 7); got != 0 {
		t.Fatalf("partition 7: %d", got)
	}
	for _, id := range []leasehold.FenceID{
		{Scope: b.Scope(), Partition: 8},
		{Scope: b.Scope(), Partition: 9999},
		{Scope: "payments", Partition: 1},
		{Scope: b.Scope() + "x", Partition: 1},
		{Scope: b.Scope() + "/", Partition: 0},
		{Scope: b.Scope() + "/account:7", Partition: 1},
	} {
		unknown(id)
	}
}
