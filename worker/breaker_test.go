package worker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// enqueueData stores one job per body on partition 0 and returns where
// each went.
func (e *env) enqueueData(t testing.TB, bodies ...string) []worker.Enqueued {
	t.Helper()
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	var out []worker.Enqueued
	for _, b := range bodies {
		q, err := p.EnqueueTo(ctx, 0, []byte(b))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, q)
	}
	return out
}

// failuresOf returns the errors of the failed attempts of the job at seq.
func failuresOf(rec *recorder, seq uint64) []error {
	var out []error
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobFailed && ev.Seq == seq {
			out = append(out, ev.Err)
		}
	}
	return out
}

func committedPast(rec *recorder, seq uint64) func() bool {
	return func() bool {
		return rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventProgressCommitted && ev.Seq >= seq }) > 0
	}
}

func gaugeValue(rm metricdata.ResourceMetrics, name string) (int64, bool) {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == name {
				var n int64
				for _, p := range g.DataPoints {
					n += p.Value
				}
				return n, true
			}
		}
	}
	return 0, false
}

// Jobs publish on a subject no stream stores, between jobs that publish
// where a stream does. The first such job waits out TransientFor before
// its failures count; then the subject's breaker opens, and every later
// job on it fails at once with the breaker's error: it runs MaxAttempts
// attempts, none of them spent waiting, and is dead-lettered. The other
// jobs of the partition go on. While the breaker is open, Ready and the
// metrics name it. Once a stream stores the subject, its jobs succeed.
func TestNoStreamSubjectFailsFast(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	const subject = "nowhere.x"
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if strings.HasPrefix(string(j.Data), "bad") {
			return j.Publish(ctx, subject, j.Data)
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	cfg.MaxAttempts = 3
	// Longer than one no-responders answer (the client asks twice, 250ms
	// apart), so that a job that waits it out fails more than
	// MaxAttempts times.
	cfg.TransientFor = 300 * time.Millisecond
	cfg.EffectTimeout = 5 * time.Second
	cfg.Telemetry = telemetry.Config{MeterProvider: mp}
	bad := []string{"bad-1", "good-1", "bad-2", "good-2", "bad-3", "good-3", "bad-4", "good-4"}
	enq := e.enqueueData(t, bad...)
	r := start(t, cfg)
	rec.waitFor(t, 2*time.Minute, "progress past every job", committedPast(rec, enq[len(enq)-1].Seq))

	var dead []uint64
	for _, m := range readStream(t, e.js, worker.DLQStream(e.prefix)) {
		dead = append(dead, uint64(mustAtoi(t, m.Headers().Get(worker.HeaderSeq))))
	}
	want := []uint64{enq[0].Seq, enq[2].Seq, enq[4].Seq, enq[6].Seq}
	if fmt.Sprint(dead) != fmt.Sprint(want) {
		t.Fatalf("dead letters for jobs %v, want the jobs on %s: %v", dead, subject, want)
	}
	got := effectKeys(t, e.js, e.prefix)
	for i := 1; i < len(enq); i += 2 {
		if !got[[2]uint64{0, enq[i].Seq}] {
			t.Errorf("job %d (another subject) has no effect: the partition did not go on", enq[i].Seq)
		}
	}
	first := failuresOf(rec, enq[0].Seq)
	t.Logf("the first job on %s failed %d times before its dead letter", subject, len(first))
	for _, q := range []worker.Enqueued{enq[2], enq[4], enq[6]} {
		errs := failuresOf(rec, q.Seq)
		fast := 0
		for _, err := range errs {
			if errors.Is(err, worker.ErrNoStream) {
				fast++
				if !strings.Contains(err.Error(), subject) || !strings.Contains(err.Error(), "leasehold init") {
					t.Errorf("the breaker's error %q does not name the subject and the fix", err)
				}
			}
		}
		if len(errs) != cfg.MaxAttempts || fast == 0 {
			t.Errorf("job %d on %s failed %d times (%d by the open breaker), want %d attempts, failing at once: %v",
				q.Seq, subject, len(errs), fast, cfg.MaxAttempts, errs)
		}
	}
	if err := r.w.Ready(context.Background()); err == nil || !strings.Contains(err.Error(), subject) {
		t.Errorf("Ready = %v while the breaker is open, want an error naming %s", err, subject)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	if n, _ := gaugeValue(rm, "leasehold.effect.subjects.unavailable"); n != 1 {
		t.Errorf("leasehold.effect.subjects.unavailable = %d, want 1", n)
	}
	if n := counterValue(rm, "leasehold.effects.no_stream"); n < 3 {
		t.Errorf("leasehold.effects.no_stream = %d, want at least one per later job", n)
	}

	// A stream now stores the subject: the breaker sees it, and jobs on
	// the subject succeed.
	if _, err := e.js.CreateStream(ctxFor(t, 10*time.Second), jetstream.StreamConfig{Name: "nowhere", Subjects: []string{"nowhere.>"}}); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, time.Minute, "Ready once a stream stores the subject", func() bool { return r.w.Ready(context.Background()) == nil })
	more := e.enqueueData(t, "bad-5", "bad-6")
	rec.waitFor(t, time.Minute, "progress past the jobs on the stored subject", committedPast(rec, more[1].Seq))
	if n := len(readStream(t, e.js, worker.DLQStream(e.prefix))); n != len(want) {
		t.Fatalf("%d dead letters, want still %d: jobs on a subject a stream now stores were dead-lettered", n, len(want))
	}
	if n := len(readStream(t, e.js, "nowhere")); n != 2 {
		t.Fatalf("stream nowhere holds %d effects, want 2", n)
	}
}

func mustAtoi(t testing.TB, s string) int {
	t.Helper()
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return n
}

// The only server of a stream that stores an effect subject goes down
// while the rest of the cluster, the job stream and the lease bucket
// with it, stays up: every publish there is answered with no responders,
// as for a subject without a stream, for longer than TransientFor. The
// stream is there, only unavailable: no attempt counts, the breaker does
// not open, and once the server is back the job succeeds. Nothing is
// dead-lettered.
func TestEffectStreamDownDeadLettersNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("a cluster takes seconds")
	}
	c := natstest.StartCluster(t)
	js := c.JetStream(t)
	ctx := ctxFor(t, time.Minute)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "jobs-leases", Replicas: 3, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "jobs", Partitions: 1, Replicas: 3}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "side", Subjects: []string{"side.>"}, Replicas: 1}); err != nil {
		t.Fatal(err)
	}
	e := &env{js: js, bucket: b, prefix: "jobs", n: 1}
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Publish(ctx, "side.x", j.Data)
	}))
	cfg.JetStream = c.JetStream(t)
	cfg.Observer = rec
	cfg.MaxAttempts = 3
	cfg.TransientFor = 100 * time.Millisecond
	cfg.EffectTimeout = 5 * time.Second
	cfg.Coordinator.TTL = 10 * time.Second
	r := start(t, cfg)
	first := e.enqueueData(t, "before")
	rec.waitFor(t, time.Minute, "the first job", committedPast(rec, first[0].Seq))

	node := c.StreamLeader(t, "side", 10*time.Second)
	c.Kill(node)
	var job []worker.Enqueued
	rec.waitFor(t, time.Minute, "a job enqueued with a node down", func() bool {
		q, err := e.tryEnqueue(0, 1)
		job = q
		return err == nil
	})
	seq := job[0].Seq
	// Past TransientFor every failure but the first would count: MaxAttempts
	// more end the job in the dead-letter stream.
	rec.waitFor(t, 2*time.Minute, "more failed attempts than MaxAttempts, or a dead letter", func() bool {
		return len(failuresOf(rec, seq)) > cfg.MaxAttempts || rec.count(kind(worker.EventJobDeadLettered)) > 0
	})
	if err := r.w.Ready(context.Background()); err != nil && strings.Contains(err.Error(), "side.x") {
		t.Errorf("Ready = %v: the breaker opened for a subject whose stream is only down", err)
	}
	c.Restart(t, node)
	rec.waitFor(t, 2*time.Minute, "progress past the job", committedPast(rec, seq))
	if n := rec.count(kind(worker.EventJobDeadLettered)); n != 0 {
		t.Fatalf("%d jobs dead-lettered while a stream's server restarted", n)
	}
	for _, err := range failuresOf(rec, seq) {
		if errors.Is(err, worker.ErrNoStream) {
			t.Fatalf("an attempt failed with the breaker's error while the stream was only down: %v", err)
		}
	}
}
