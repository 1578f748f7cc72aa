package coordinator_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// BenchmarkLeaseOps measures one goroutine's lease operations beside raw KV
// compare-and-set on the same embedded server, in the same run:
//
//	go test ./coordinator -run '^$' -bench LeaseOps -count 5
//
// raw-cas is kv.Update with the expected revision; renew is a lease renewal
// (compare-and-set carrying the TTL); acquire+release is a full cycle:
// acquire (create, read and fence the progress record) and release (purge).
func BenchmarkLeaseOps(b *testing.B) {
	s := natstest.Start(b)
	js := s.JetStream(b)
	ctx := context.Background()
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{})
	if err != nil {
		b.Fatal(err)
	}
	c, err := coordinator.New(bucket, coordinator.Config{Worker: "bench", TTL: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	value := make([]byte, 128)

	b.Run("raw-cas", func(b *testing.B) {
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "raw", Storage: jetstream.FileStorage})
		if err != nil {
			b.Fatal(err)
		}
		rev, err := kv.Put(ctx, "k", value)
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if rev, err = kv.Update(ctx, "k", value, rev); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
	})
	b.Run("renew", func(b *testing.B) {
		l, err := c.Acquire(ctx, 0, coordinator.ManualRenew())
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if err := l.Renew(ctx); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
		l.Release(ctx)
	})
	b.Run("acquire+release", func(b *testing.B) {
		p := 0
		for b.Loop() {
			l, err := c.Acquire(ctx, leasehold.Partition(p%leasehold.MaxPartitions), coordinator.ManualRenew())
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				b.Fatal(err)
			}
			p++
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
	})
}
