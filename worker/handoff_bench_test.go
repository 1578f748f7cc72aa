package worker_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// BenchmarkHandOff measures graceful hand-off: worker A runs all 16
// partitions of a backlog; B joins, and A hands half of them over. For
// each moved partition the hand-off time runs from A's revoke (the drain
// starts) to B starting the partition's next job; it covers A's drain and
// commit, the release, B's acquisition and fencing, its barrier and its
// first pull. It reports the median and the largest over all moved
// partitions of all iterations, and the median drain.
//
//	go test -run '^$' -bench HandOff -benchtime 5x -count 3 ./worker/
func BenchmarkHandOff(b *testing.B) {
	const n = 16
	srv := natstest.Start(b, natstest.Listen())
	var handoffs, drains []float64
	b.StopTimer()
	for i := range b.N {
		h, d := handOffOnce(b, srv, fmt.Sprintf("ho%d", i), n)
		handoffs = append(handoffs, h...)
		drains = append(drains, d...)
	}
	b.ReportMetric(median(handoffs), "handoff_median_ms")
	b.ReportMetric(maxOf(handoffs), "handoff_max_ms")
	b.ReportMetric(median(drains), "drain_median_ms")
	b.ReportMetric(0, "ns/op")
}

func maxOf(xs []float64) float64 {
	m := 0.0
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}

func handOffOnce(b *testing.B, srv *natstest.Server, prefix string, n int) (handoffs, drains []float64) {
	b.Helper()
	js := srv.JetStream(b)
	if err := worker.ProvisionJobs(ctxFor(b, 30*time.Second), js, worker.JobsConfig{Prefix: prefix, Partitions: n}); err != nil {
		b.Fatal(err)
	}
	bucket, err := coordinator.Provision(ctxFor(b, 30*time.Second), js, coordinator.BucketConfig{Bucket: prefix + "-leases", MarkerTTL: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	// A backlog that outlasts the hand-off: 2,000 jobs a partition at no
	// more than 1,000 a second each.
	prod, err := worker.NewProducer(srv.JetStream(b), worker.ProducerConfig{Prefix: prefix, Partitions: n})
	if err != nil {
		b.Fatal(err)
	}
	ctx := ctxFor(b, time.Minute)
	batch := prod.Batch()
	for i := range 2000 * n {
		if err := batch.EnqueueTo(ctx, leasehold.Partition(i%n), []byte("job")); err != nil {
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

	var mu sync.Mutex
	revoked := map[leasehold.Partition]time.Time{}
	started := map[leasehold.Partition]time.Time{}
	drained := map[leasehold.Partition]time.Duration{}
	readyA := 0
	allReady, moved := make(chan struct{}), make(chan struct{})
	obs := worker.ObserverFunc(func(_ context.Context, e worker.Event) {
		mu.Lock()
		defer mu.Unlock()
		p := e.Lease.Partition
		switch {
		case e.Kind == worker.EventPartitionReady && e.Lease.Holder == prefix+"-a":
			if readyA++; readyA == n {
				close(allReady)
			}
		case e.Kind == worker.EventPartitionRevoked && e.Lease.Holder == prefix+"-a":
			if _, ok := revoked[p]; !ok {
				revoked[p] = e.Time
			}
		case e.Kind == worker.EventPartitionDrained && e.Lease.Holder == prefix+"-a":
			if _, ok := drained[p]; !ok {
				drained[p] = e.Duration
			}
		case e.Kind == worker.EventJobStarted && e.Lease.Holder == prefix+"-b":
			if _, ok := started[p]; !ok {
				started[p] = e.Time
				if len(started) == n/2 {
					close(moved)
				}
			}
		}
	})
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		time.Sleep(time.Millisecond)
		return j.Emit(ctx, j.Data)
	})
	cfg := func(name string) worker.Config {
		return worker.Config{
			JetStream:   srv.JetStream(b),
			Prefix:      prefix,
			Partitions:  n,
			Handler:     h,
			Bucket:      bucket,
			Coordinator: coordinator.Config{Worker: prefix + "-" + name},
			Logger:      testLogger(),
			Observer:    obs,
		}
	}
	a := start(b, cfg("a"))
	wait(b, allReady, "A to run every partition")
	b.StartTimer()
	bw := start(b, cfg("b"))
	wait(b, moved, "B to run half of the partitions")
	b.StopTimer()
	bw.stop(b)
	a.stop(b)
	mu.Lock()
	defer mu.Unlock()
	for p, t := range started {
		r, ok := revoked[p]
		if !ok {
			b.Fatalf("B ran partition %d, which A never revoked", p)
		}
		handoffs = append(handoffs, float64(t.Sub(r))/float64(time.Millisecond))
		drains = append(drains, float64(drained[p])/float64(time.Millisecond))
	}
	return handoffs, drains
}

func wait(b *testing.B, ch chan struct{}, what string) {
	b.Helper()
	select {
	case <-ch:
	case <-time.After(time.Minute):
		b.Fatalf("waiting for %s", what)
	}
}
