package streamsink_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A BatchHandler call holds at most HandlerBatch effects, and never part of
// a job's effects: a destination that writes each call atomically (kvsink,
// pgsink) applies every job whole, and a job of more effects than
// HandlerBatch comes in a call of its own. The runner reads a backlog of
// jobs of three effects and one of five, many per fetch.
func TestBatchHandlerCallsHoldWholeJobs(t *testing.T) {
	t.Parallel()
	const handlerBatch = 4
	js, last, want := handlerCallsWorld(t, "hcalls", handlerBatch)
	ctx := ctxFor(t, time.Minute)
	var mu sync.Mutex
	var calls [][]string
	r := start(t, js, streamsink.Config{Prefix: "hcalls", HandlerBatch: handlerBatch, MaxBackoff: 10 * time.Millisecond,
		BatchHandler: func(_ context.Context, effs []sink.Effect) error {
			var call []string
			for _, e := range effs {
				call = append(call, string(e.Data))
			}
			mu.Lock()
			calls = append(calls, call)
			mu.Unlock()
			return nil
		}})
	if err := r.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	checkWholeJobs(t, calls, handlerBatch, want)
}

// A call the destination fails while it is away (sink.ErrUnavailable) is
// tried again whole, the calls before it are not handed over again, and
// the job it holds is applied whole, once: never part of it.
func TestBatchHandlerCallFailedWhileAwayIsTriedAgainWhole(t *testing.T) {
	t.Parallel()
	const handlerBatch = 4
	js, last, want := handlerCallsWorld(t, "hcallsaway", handlerBatch)
	ctx := ctxFor(t, time.Minute)
	var mu sync.Mutex
	var calls [][]string
	failed := 0
	r := start(t, js, streamsink.Config{Prefix: "hcallsaway", HandlerBatch: handlerBatch, MaxBackoff: 10 * time.Millisecond,
		BatchHandler: func(_ context.Context, effs []sink.Effect) error {
			mu.Lock()
			defer mu.Unlock()
			// The destination is away for the second call, and the
			// one holding the job of five effects, three times each.
			if (len(calls) == 1 || len(effs) > handlerBatch) && failed < 6 {
				failed++
				return fmt.Errorf("destination restarting: %w", sink.ErrUnavailable)
			}
			var call []string
			for _, e := range effs {
				call = append(call, string(e.Data))
			}
			calls = append(calls, call)
			return nil
		}})
	if err := r.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if failed != 6 {
		t.Errorf("the destination was away for %d calls, want 6", failed)
	}
	checkWholeJobs(t, calls, handlerBatch, want)
}

// handlerCallsWorld runs a worker over 20 jobs under prefix, of three
// effects each but one of handlerBatch+1, each effect's data "seq/i/n",
// and waits until the effect log holds them all. It returns the last
// one's position and how many there are.
func handlerCallsWorld(t *testing.T, prefix string, handlerBatch int) (jetstream.JetStream, uint64, int) {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 2*time.Minute)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: prefix + "-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		n, _ := strconv.Atoi(string(j.Data))
		for i := range n {
			if err := j.Emit(ctx, fmt.Appendf(nil, "%d/%d/%d", j.Seq, i, n)); err != nil {
				return err
			}
		}
		return nil
	})
	w, err := worker.New(worker.Config{
		JetStream: js, Prefix: prefix, Partitions: 1, Bucket: bucket, Handler: h,
		Coordinator: coordinator.Config{Worker: "w1", TTL: 2 * time.Second, RebalanceDelay: 100 * time.Millisecond, Logger: quiet()},
		Logger:      quiet(),
	})
	if err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(context.Background())
	wdone := make(chan struct{})
	go func() { defer close(wdone); _ = w.Run(wctx) }()
	t.Cleanup(func() { stop(); <-wdone })
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	const jobs = 20
	want := 0
	for i := range jobs {
		n := 3
		if i == jobs/2 {
			n = handlerBatch + 1
		}
		want += n
		if _, err := p.Enqueue(ctx, []byte(fmt.Sprint(i)), []byte(strconv.Itoa(n))); err != nil {
			t.Fatal(err)
		}
	}
	// The whole log first, so that the runner's fetches hold many jobs.
	return js, waitEffects(t, ctx, js, prefix, want), want
}

// checkWholeJobs fails t for a call that holds part of a job's effects, or
// effects of more than one job beyond handlerBatch, and for an effect
// applied twice or not at all.
func checkWholeJobs(t *testing.T, calls [][]string, handlerBatch, want int) {
	t.Helper()
	seen := map[string]bool{}
	for _, call := range calls {
		perJob := map[string]int{}
		total := map[string]int{}
		for _, d := range call {
			f := strings.Split(d, "/")
			if seen[d] {
				t.Errorf("effect %s applied twice", d)
			}
			seen[d] = true
			perJob[f[0]]++
			total[f[0]], _ = strconv.Atoi(f[2])
		}
		for job, k := range perJob {
			if k != total[job] {
				t.Errorf("a call holds %d of the %d effects of job %s: %v", k, total[job], job, call)
			}
		}
		if len(call) > handlerBatch && len(perJob) > 1 {
			t.Errorf("a call holds %d effects of %d jobs, above HandlerBatch %d: %v", len(call), len(perJob), handlerBatch, call)
		}
	}
	if len(seen) != want {
		t.Errorf("%d effects applied, want %d", len(seen), want)
	}
}

// waitEffects waits until the effect log under prefix holds n messages,
// and returns the last one's position.
func waitEffects(t *testing.T, ctx context.Context, js jetstream.JetStream, prefix string, n int) uint64 {
	t.Helper()
	for {
		s, err := js.Stream(ctx, worker.EffectsStream(prefix))
		if err == nil {
			if info, err := s.Info(ctx); err == nil && info.State.Msgs >= uint64(n) {
				return info.State.LastSeq
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the effect log does not hold %d effects: %v", n, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
