package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// On a three-node cluster with replicated streams and lease bucket, the
// node leading the job stream is killed while workers run, and comes back:
// every job still ends up with its effect.
func TestClusterLeaderKill(t *testing.T) {
	if testing.Short() {
		t.Skip("a cluster fail-over takes seconds")
	}
	const n = 4
	c := natstest.StartCluster(t)
	js := c.JetStream(t)
	ctx := ctxFor(t, time.Minute)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "jobs-leases", Replicas: 3, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "jobs", Partitions: n, Replicas: 3}); err != nil {
		t.Fatal(err)
	}
	e := &env{js: js, bucket: b, prefix: "jobs", n: n}
	var runs runLog
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		time.Sleep(500 * time.Microsecond)
		return j.Emit(ctx, j.Data)
	})
	for _, name := range []string{"a", "b"} {
		cfg := e.config(name, h)
		cfg.JetStream = c.JetStream(t)
		cfg.Coordinator.TTL = 3 * time.Second
		cfg.EffectTimeout = 3 * time.Second
		cfg.FetchWait = time.Second
		cfg.Observer = rec
		start(t, cfg)
	}
	enq := e.enqueue(t, 0, 1500)
	rec.waitFor(t, time.Minute, "jobs to flow", func() bool { return runs.n.Load() > 300 })
	leader := c.StreamLeader(t, worker.JobsStream("jobs"), 10*time.Second)
	c.Kill(leader)
	more, err := e.tryEnqueue(1500, 500)
	if err != nil {
		t.Fatalf("enqueue while a node is down: %v", err)
	}
	enq = append(enq, more...)
	c.Restart(t, leader)

	want := map[[2]uint64]bool{}
	for _, q := range enq {
		want[[2]uint64{uint64(q.Partition), q.Seq}] = true
	}
	rec.waitFor(t, 2*time.Minute, "every job's effect", func() bool {
		got, err := tryEffectKeys(js, "jobs")
		if err != nil {
			return false
		}
		for k := range want {
			if !got[k] {
				return false
			}
		}
		return true
	})
	t.Logf("%d jobs, %d runs, %d leases lost", len(want), len(runs.all()), rec.count(kind(worker.EventPartitionLost)))
}
