package coordinator_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
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
// acquire (create the lease, read and fence the fence record) and release
// (purge); lock+release is the same on a named lock, over 5,000 names.
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
	b.Run("lock+release", func(b *testing.B) {
		i := 0
		for b.Loop() {
			l, err := c.TryLock(ctx, "account:"+strconv.Itoa(i%5000), coordinator.ManualRenew())
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				b.Fatal(err)
			}
			i++
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
	})
}

// BenchmarkRecreate measures re-creating a deleted lease bucket next to a
// full fence-record bucket (65,536 partitions and 5,000 locks): Provision
// reads every fence record for the highest epoch. The records hold the
// previous release's history (8 epochs) or this release's (32
// acquisitions with their tokens).
//
//	go test ./coordinator -run '^$' -bench Recreate -benchtime 5x
func BenchmarkRecreate(b *testing.B) {
	for _, history := range []int{8, coordinator.FenceHistory} {
		b.Run(fmt.Sprintf("history=%d", history), func(b *testing.B) { benchRecreate(b, history) })
	}
}

func benchRecreate(b *testing.B, history int) {
	s := natstest.Start(b)
	js := s.JetStream(b)
	ctx := context.Background()
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{})
	if err != nil {
		b.Fatal(err)
	}
	const partitions, locks = leasehold.MaxPartitions, 5000
	var epochs, tokens []string
	for i := range history {
		epochs = append(epochs, strconv.Itoa(1_600_000_000_000_000+i*1_000_003))
		tokens = append(tokens, strconv.Quote(fmt.Sprintf("%024x", i)))
	}
	recent := `[` + strings.Join(epochs, ",") + `]`
	if history > 8 {
		recent += `,"acquisitions":[` + strings.Join(tokens, ",") + `]`
	}
	var size int
	for i := range partitions + locks {
		key := "partition." + strconv.Itoa(i)
		if i >= partitions {
			key = "lock.account_3A" + strconv.Itoa(i-partitions)
		}
		value := `{"epoch":` + strconv.Itoa(1_700_000_000_000_000+i) + `,"acquisition":"0123456789abcdef01234567","seq":123456,"holder":"worker-0123456789","recent":` + recent + `}`
		size = len(value)
		if _, err := js.PublishAsync("$KV."+bucket.FenceBucket()+"."+key, []byte(value)); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("fence records not stored within a minute")
	}
	for b.Loop() {
		if err := js.DeleteStream(ctx, "KV_"+bucket.Name()); err != nil {
			b.Fatal(err)
		}
		if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(partitions+locks), "records")
	b.ReportMetric(float64(size), "bytes/record")
	b.ReportMetric(b.Elapsed().Seconds()*1000/float64(b.N), "ms/recreate")
}
