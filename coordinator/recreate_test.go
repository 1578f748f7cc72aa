package coordinator_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// I1 and progress across the lease bucket's re-creation: a machine whose
// clock is an hour behind deletes the lease bucket and provisions it
// again. Every partition's and every lock's next epoch is above its
// earlier ones, and the progress committed before is where it was.
func TestRecreationWithAClockBehind(t *testing.T) {
	onEachTopology(t, func(t *testing.T, js jetstream.JetStream, replicas int) {
		ctx := ctxFor(t, 60*time.Second)
		cfg := coordinator.BucketConfig{Bucket: "orders-leases", Replicas: replicas, MarkerTTL: time.Second}
		b, err := coordinator.Provision(ctx, js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		jobStream(t, js, "orders", 8, 40)
		c := newCoord(t, b, "a", 2*time.Second)
		epochs := map[string]leasehold.Epoch{}
		for p := range leasehold.Partition(8) {
			l, err := c.Acquire(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Commit(ctx, uint64(10+p)); err != nil {
				t.Fatal(err)
			}
			epochs[p.String()] = l.Epoch()
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		for _, name := range []string{"report-generator", "account:42"} {
			l, err := c.TryLock(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			epochs[name] = l.Epoch()
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}

		if err := js.DeleteStream(ctx, "KV_"+b.Name()); err != nil {
			t.Fatal(err)
		}
		behind := time.Now().Add(-time.Hour)
		restore := coordinator.SetWallClock(func() time.Time { return behind })
		b, err = coordinator.Provision(ctx, js, cfg)
		restore()
		if err != nil {
			t.Fatal(err)
		}
		if clock := leasehold.Epoch(behind.UnixMicro()); clock >= epochs["0"] {
			t.Fatalf("the clock an hour behind (%d) is not below the old epochs (%d): the test shows nothing", clock, epochs["0"])
		}
		c = newCoord(t, b, "b", 2*time.Second)
		for p := range leasehold.Partition(8) {
			l, err := c.Acquire(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			if l.Epoch() <= epochs[p.String()] {
				t.Errorf("partition %d: epoch %d after re-creation, %d before", p, l.Epoch(), epochs[p.String()])
			}
			if l.Progress() != uint64(10+p) {
				t.Errorf("partition %d resumes after %d, want %d", p, l.Progress(), 10+p)
			}
			_ = l.Release(ctx)
		}
		for _, name := range []string{"report-generator", "account:42"} {
			l, err := c.TryLock(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if l.Epoch() <= epochs[name] {
				t.Errorf("lock %s: token %d after re-creation, %d before", name, l.Epoch(), epochs[name])
			}
			_ = l.Release(ctx)
		}
	})
}

// With the fence records gone too and a job stream that has been used,
// Provision refuses, and says how to go on: a floor for the epochs and
// consent to progress starting over. Given both, it starts above the floor.
func TestRecreationWithoutFenceRecordsIsRefused(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	cfg := coordinator.BucketConfig{Bucket: "orders-leases", MarkerTTL: time.Second}
	b, err := coordinator.Provision(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	before := cycle(t, newCoord(t, b, "a", 2*time.Second), 3)

	// The lease bucket alone may go: its fence records carry epochs and
	// progress. The fence records alone may not, once jobs ran.
	jobStream(t, js, "orders", 4, 3)
	if err := js.DeleteStream(ctx, "KV_"+b.FenceBucket()); err != nil {
		t.Fatal(err)
	}
	_, err = coordinator.Provision(ctx, js, cfg)
	for _, want := range []string{"fence-record bucket orders-leases-fences of lease bucket orders-leases is missing", "orders-jobs", "RestartProgress", "--restart-progress", "epochs are safe"} {
		if !errors.Is(err, coordinator.ErrBucketConfig) || !strings.Contains(err.Error(), want) {
			t.Fatalf("Provision without fence records: %v; want ErrBucketConfig saying %q", err, want)
		}
	}
	if _, err := coordinator.OpenBucket(ctx, js, cfg.Bucket); !errors.Is(err, coordinator.ErrBucketConfig) {
		t.Fatalf("OpenBucket without fence records: %v", err)
	}

	// Both gone: a floor is needed as well.
	if err := js.DeleteStream(ctx, "KV_"+b.Name()); err != nil {
		t.Fatal(err)
	}
	for _, c := range []coordinator.BucketConfig{cfg, {Bucket: cfg.Bucket, RestartProgress: true}, {Bucket: cfg.Bucket, EpochFloor: before}} {
		_, err = coordinator.Provision(ctx, js, c)
		for _, want := range []string{"both missing", "holds 3 jobs", "EpochFloor", "--epoch-floor", "RestartProgress", "--restart-progress"} {
			if !errors.Is(err, coordinator.ErrBucketConfig) || !strings.Contains(err.Error(), want) {
				t.Fatalf("Provision(%+v) with both buckets gone: %v; want ErrBucketConfig saying %q", c, err, want)
			}
		}
	}
	floor := before + 1<<40
	b, err = coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: cfg.Bucket, MarkerTTL: time.Second, EpochFloor: floor, RestartProgress: true})
	if err != nil {
		t.Fatal(err)
	}
	l, err := newCoord(t, b, "a", 2*time.Second).Acquire(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if l.Epoch() <= floor || l.Progress() != 0 {
		t.Fatalf("after the restart: epoch %d (floor %d), progress %d", l.Epoch(), floor, l.Progress())
	}
}

// A fence record that claims an epoch no lease bucket issues cannot lift a
// re-created bucket out of range: Provision refuses, naming it.
func TestRecreationRefusesAForgedFloor(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 20*time.Second)
	b := provision(t, js, 1)
	if _, err := b.FenceRecords().Put(ctx, "partition.9", []byte(`{"epoch":9223372036854775807,"holder":"forger"}`)); err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteStream(ctx, "KV_"+b.Name()); err != nil {
		t.Fatal(err)
	}
	_, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: time.Second})
	if !errors.Is(err, coordinator.ErrBucketConfig) || !strings.Contains(err.Error(), "partition.9") || !strings.Contains(err.Error(), "forged") {
		t.Fatalf("Provision over a forged fence record: %v", err)
	}
}

// A fresh deployment needs neither: no job stream, or an empty one.
func TestProvisionFresh(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 20*time.Second)
	jobStream(t, js, "fresh", 2, 0)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "fresh-leases"})
	if err != nil {
		t.Fatal(err)
	}
	if b.FenceBucket() != "fresh-leases-fences" || b.Scope() != "fresh" {
		t.Fatalf("bucket %s scope %s fences %s", b.Name(), b.Scope(), b.FenceBucket())
	}
	// Named explicitly, and checked on the way in.
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "fresh-leases", FenceBucket: "elsewhere"}); !errors.Is(err, coordinator.ErrBucketConfig) {
		t.Fatalf("Provision naming another fence bucket: %v", err)
	}
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "lossy", TTL: time.Hour, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	_, err = coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "other-leases", FenceBucket: "lossy"})
	for _, want := range []string{"memory", "TTL"} {
		if !errors.Is(err, coordinator.ErrBucketConfig) || !strings.Contains(err.Error(), want) {
			t.Fatalf("Provision over a fence bucket that loses records: %v; want it to say %q", err, want)
		}
	}
}
