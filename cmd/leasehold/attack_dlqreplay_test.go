package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// A stream sink's destination refuses a job's effect until the runner
// dead-letters it (the job is committed by then: the worker's part is
// done). The destination is fixed and the operator does what `leasehold
// dlq replay --help` says: replay the effect. The partition has not
// changed hands, so the sink must apply the replayed effect; a replay that
// is stored, reported done and then dropped by the runner as a copy of
// what it handled leaves the committed job's effect applied nowhere.
func TestAttackSinkDeadLetterReplayIsApplied(t *testing.T) {
	const prefix = "rq"
	s, ctx := initialized(t, 2*time.Minute, "--prefix", prefix, "--partitions", "1")
	js := s.JetStream(t)
	bucket, err := coordinator.OpenBucket(ctx, js, prefix+"-leases")
	if err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	var refusing atomic.Bool
	refusing.Store(true)
	var mu sync.Mutex
	applied := map[string]int{}
	decided := make(chan sink.Decision, 256)
	r, err := streamsink.New(ctx, js, streamsink.Config{Prefix: prefix, Verifier: bucket, MaxDeliveries: 1, MaxBackoff: 10 * time.Millisecond, Logger: quiet,
		Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
			select {
			case decided <- d:
			default:
			}
		}),
		Handler: func(_ context.Context, e sink.Effect) error {
			if refusing.Load() {
				return errors.New("the destination refuses it for now")
			}
			mu.Lock()
			applied[e.Stamp.Key]++
			mu.Unlock()
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stopRunner := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- r.Run(rctx) }()
	defer func() {
		stopRunner()
		<-runDone
	}()

	prog := startReplayWorker(t, js, prefix, bucket, quiet)
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	job, err := p.Enqueue(ctx, []byte("k"), []byte("pay 10"))
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 0, job.Seq)
	key := leasehold.EffectKey(prefix, 0, job.Seq, 0)
	for d := range decided {
		if d.Stamp.Key == key && d.Outcome == sink.DeadLettered {
			break
		}
	}
	refusing.Store(false)

	out := mustRun(t, ctx, "dlq", "replay", "--all", "--sink", "--nats", s.URL(), "--prefix", prefix)
	t.Logf("dlq replay --all --sink:\n%s", out)
	wantIn(t, "replay", out, "1 replayed")
	waitSinkSettled(t, ctx, js, prefix, r)
	mu.Lock()
	n := applied[key]
	mu.Unlock()
	if n != 1 {
		var last sink.Decision
	drain:
		for {
			select {
			case d := <-decided:
				if d.Stamp.Key == key {
					last = d
				}
			default:
				break drain
			}
		}
		t.Fatalf("job %d was committed, its effect %s dead-lettered and replayed into the log under the same lease; it was applied %d times, want once (the runner's last decision on it: %v %s %v)",
			job.Seq, key, n, last.Outcome, last.Suspect, last.Err)
	}
}

// startReplayWorker runs a worker whose handler emits one effect per job.
func startReplayWorker(t *testing.T, js jetstream.JetStream, prefix string, bucket *coordinator.Bucket, log *slog.Logger) *progress {
	t.Helper()
	prog := newProgress()
	w, err := worker.New(worker.Config{
		JetStream: js, Prefix: prefix, Partitions: 1, Bucket: bucket,
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			return j.Emit(ctx, []byte(fmt.Sprintf("effect of %s", j.Data)))
		}),
		Coordinator: coordinator.Config{Worker: "w", TTL: 2 * time.Second, Logger: log},
		Observer:    prog,
		Logger:      log,
	})
	if err != nil {
		t.Fatal(err)
	}
	runTestWorker(t, w)
	return prog
}
