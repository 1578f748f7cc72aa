package worker_test

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// BenchmarkEnqueue compares Producer.Enqueue, which waits for each job's
// ack, with a Batch of 1,000 that waits once per batch, on one server over
// loopback TCP with 256-byte jobs.
//
//	go test -run '^$' -bench Enqueue -count 5 ./worker/
func BenchmarkEnqueue(b *testing.B) {
	srv := natstest.Start(b, natstest.Listen())
	js := srv.JetStream(b)
	if err := worker.ProvisionJobs(ctxFor(b, 30*time.Second), js, worker.JobsConfig{Prefix: "enq", Partitions: 16}); err != nil {
		b.Fatal(err)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "enq", Partitions: 16})
	if err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, benchPayload)
	key := []byte("customer-42")
	b.Run("sync", func(b *testing.B) {
		ctx := ctxFor(b, 10*time.Minute)
		for b.Loop() {
			if _, err := p.Enqueue(ctx, key, payload); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "jobs/s")
	})
	b.Run("batch", func(b *testing.B) {
		ctx := ctxFor(b, 10*time.Minute)
		batch := p.Batch()
		for b.Loop() {
			if err := batch.Enqueue(ctx, key, payload); err != nil {
				b.Fatal(err)
			}
			if batch.Len() == 1000 {
				if _, err := batch.Wait(ctx); err != nil {
					b.Fatal(err)
				}
			}
		}
		if _, err := batch.Wait(ctx); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "jobs/s")
	})
}
