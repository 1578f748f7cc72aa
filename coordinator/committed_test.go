package coordinator_test

import (
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Committed reads a partition's progress as its fence record holds it:
// nothing before the partition is fenced, the holder and what it
// committed, the successor with the progress it took over, and for a lock
// the holder with no progress. A fence the bucket does not serve is
// refused, on one node and on the cluster.
func TestCommitted(t *testing.T) {
	for _, topo := range []string{"single", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			var js jetstream.JetStream
			replicas := 1
			if topo == "cluster" {
				js, replicas = natstest.StartCluster(t).JetStream(t), 3
			} else {
				js = natstest.Start(t).JetStream(t)
			}
			b := provisionWithJobs(t, js, replicas, 4, 0)
			ctx := ctxFor(t, 30*time.Second)
			p0 := leasehold.FenceID{Scope: b.Scope(), Partition: 0}

			got, err := b.Committed(ctx, p0)
			if err != nil || !reflect.DeepEqual(got, coordinator.Committed{}) {
				t.Fatalf("before any acquisition: %+v, %v; want the zero Committed", got, err)
			}

			a := newCoord(t, b, "a", 5*time.Second)
			la, err := a.Acquire(ctx, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := la.Commit(ctx, 7); err != nil {
				t.Fatal(err)
			}
			got, err = b.Committed(ctx, p0)
			want := coordinator.Committed{Epoch: la.Epoch(), Acquisition: la.Info().Acquisition, Seq: 7}
			if err != nil || !reflect.DeepEqual(got, want) {
				t.Fatalf("after the holder committed 7: %+v, %v; want %+v", got, err, want)
			}
			if !got.Includes(7) || !got.Includes(1) || got.Includes(8) || got.Includes(0) {
				t.Errorf("%+v: Includes(1, 7, 8, 0) = %v %v %v %v, want true true false false", got, got.Includes(1), got.Includes(7), got.Includes(8), got.Includes(0))
			}
			if err := la.Release(ctx); err != nil {
				t.Fatal(err)
			}

			c := newCoord(t, b, "c", 5*time.Second)
			lc := acquireEventually(t, c, 0, 20*time.Second)
			defer lc.Release(ctx)
			got, err = b.Committed(ctx, p0)
			want = coordinator.Committed{Epoch: lc.Epoch(), Acquisition: lc.Info().Acquisition, Seq: 7}
			if err != nil || !reflect.DeepEqual(got, want) {
				t.Fatalf("after a successor fenced the record: %+v, %v; want %+v", got, err, want)
			}
			if got.Epoch <= la.Epoch() {
				t.Errorf("the successor's epoch %d is not above the first holder's %d", got.Epoch, la.Epoch())
			}

			lk, err := a.Lock(ctx, "batch")
			if err != nil {
				t.Fatal(err)
			}
			defer lk.Release(ctx)
			got, err = b.Committed(ctx, lk.Info().Fence())
			want = coordinator.Committed{Epoch: lk.Epoch(), Acquisition: lk.Info().Acquisition}
			if err != nil || !reflect.DeepEqual(got, want) {
				t.Errorf("a lock: %+v, %v; want %+v", got, err, want)
			}

			if _, err := b.Committed(ctx, leasehold.FenceID{Scope: "elsewhere", Partition: 0}); !errors.Is(err, coordinator.ErrUnknownFence) {
				t.Errorf("a fence of another scope: %v, want ErrUnknownFence", err)
			}
		})
	}
}
