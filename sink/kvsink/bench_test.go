package kvsink_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// BenchmarkApply weighs a fenced Apply against an unfenced KV put of the
// same value, in the same run, on one server (a bucket of one replica on
// file storage) and on a 3-node cluster (three replicas), with one effect
// per Apply and with 100. It reports the medians of fenced and plain µs
// per effect and their ratio, over rounds that alternate the two.
//
// nats-server stages the messages of an atomic batch to a stream of one
// replica on file storage in a temporary file store of its own, which it
// creates, syncs and removes for every batch; a replicated stream stages
// them in memory. That is most of the difference between the two rows.
//
//	go test ./sink/kvsink -run '^$' -bench Apply -benchtime 1x
func BenchmarkApply(b *testing.B) {
	for _, topo := range []string{"single", "cluster"} {
		b.Run(topo, func(b *testing.B) {
			var js jetstream.JetStream
			replicas := 1
			if topo == "cluster" {
				js, replicas = natstest.StartCluster(b).JetStream(b), 3
			} else {
				js = natstest.Start(b).JetStream(b)
			}
			for _, per := range []int{1, 100} {
				b.Run(fmt.Sprintf("effects=%d", per), func(b *testing.B) {
					for b.Loop() {
						fenced, plain := applyRounds(b, js, replicas, per)
						b.ReportMetric(fenced, "fenced_us/effect")
						b.ReportMetric(plain, "plain_us/effect")
						b.ReportMetric(fenced/plain, "ratio")
					}
				})
			}
		})
	}
}

func applyRounds(b *testing.B, js jetstream.JetStream, replicas, per int) (fenced, plain float64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	name := fmt.Sprintf("bench-%d-%d", replicas, per)
	s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: name, Replicas: replicas, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: name + "-plain", Replicas: replicas, Storage: jetstream.FileStorage})
	if err != nil {
		b.Fatal(err)
	}
	const rounds, effects = 5, 600
	data := make([]byte, 256)
	var f, p []float64
	n := 0
	for range rounds {
		start := time.Now()
		for i := 0; i < effects; i += per {
			batch := make([]sink.Effect, 0, per)
			for j := range per {
				n++
				batch = append(batch, sink.Effect{
					Stamp:   leasehold.Stamp{Scope: "orders", Partition: leasehold.Partition(j % 4), Epoch: 5, Acquisition: "a5", Key: fmt.Sprintf("k%d", n), Worker: "w"},
					Subject: fmt.Sprintf("orders.%d", n%1000),
					Data:    data,
				})
			}
			if err := s.Apply(ctx, batch...); err != nil {
				b.Fatal(err)
			}
		}
		f = append(f, float64(time.Since(start).Microseconds())/effects)

		start = time.Now()
		for i := 0; i < effects; i += per {
			if per == 1 {
				if _, err := kv.Put(ctx, fmt.Sprintf("orders.%d", i%1000), data); err != nil {
					b.Fatal(err)
				}
				continue
			}
			futures := make([]jetstream.PubAckFuture, 0, per)
			for j := range per {
				fut, err := js.PublishAsync(fmt.Sprintf("$KV.%s-plain.orders.%d", name, (i+j)%1000), data)
				if err != nil {
					b.Fatal(err)
				}
				futures = append(futures, fut)
			}
			for _, fut := range futures {
				select {
				case <-fut.Ok():
				case err := <-fut.Err():
					b.Fatal(err)
				case <-ctx.Done():
					b.Fatal(ctx.Err())
				}
			}
		}
		p = append(p, float64(time.Since(start).Microseconds())/effects)
	}
	slices.Sort(f)
	slices.Sort(p)
	return f[len(f)/2], p[len(p)/2]
}
