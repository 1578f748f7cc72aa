package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// More attacks on `leasehold dlq replay`, with the effect log consumed by a
// stream sink runner that verifies epochs (as `leasehold sink` runs it) in
// front of a destination that dedupes by key, and workers that run several
// jobs of a partition at once (the default): the operator follows the
// documented recovery path, and no committed job may be lost or applied
// twice.

// openAttack skips an attack that still gets through unless
// LEASEHOLD_ATTACK_OPEN=1: it fails until the product is fixed.
func openAttack(t *testing.T) {
	t.Helper()
	if os.Getenv("LEASEHOLD_ATTACK_OPEN") != "1" {
		t.Skip("an attack that still gets through: run with LEASEHOLD_ATTACK_OPEN=1")
	}
}

// replayWorld is a job stream of one partition made by `leasehold init`, a
// stream sink runner with the lease bucket as its Verifier and a
// destination that dedupes by key, and the decisions the runner made.
type replayWorld struct {
	url    string
	prefix string
	js     jetstream.JetStream
	bucket *coordinator.Bucket
	runner *streamsink.Runner
	quiet  *slog.Logger

	// refuse, while it holds a key, makes the destination refuse that
	// key's effect as poison (it goes to the sink's dead-letter stream).
	mu       sync.Mutex
	refuse   map[string]bool
	applied  map[string][]string
	notify   chan struct{}
	decided  map[string][]sink.Decision
	refusing atomic.Bool
}

func newReplayWorld(t *testing.T, ctx context.Context, prefix string) *replayWorld {
	t.Helper()
	s := natstest.Start(t, natstest.Listen())
	mustRun(t, ctx, "init", "--nats", s.URL(), "--prefix", prefix, "--partitions", "1")
	js := s.JetStream(t)
	bucket, err := coordinator.OpenBucket(ctx, js, prefix+"-leases")
	if err != nil {
		t.Fatal(err)
	}
	rw := &replayWorld{url: s.URL(), prefix: prefix, js: js, bucket: bucket, quiet: slog.New(slog.NewTextHandler(io.Discard, nil)),
		refuse: map[string]bool{}, applied: map[string][]string{}, notify: make(chan struct{}, 1), decided: map[string][]sink.Decision{}}
	r, err := streamsink.New(ctx, js, streamsink.Config{Prefix: prefix, Verifier: bucket, MaxBackoff: 10 * time.Millisecond, Logger: rw.quiet,
		Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
			rw.mu.Lock()
			rw.decided[d.Stamp.Key] = append(rw.decided[d.Stamp.Key], d)
			rw.mu.Unlock()
			rw.poke()
		}),
		Handler: func(_ context.Context, e sink.Effect) error {
			rw.mu.Lock()
			defer rw.mu.Unlock()
			if rw.refusing.Load() {
				return fmt.Errorf("%w: the ledger is closed for the night", streamsink.ErrPoison)
			}
			if len(rw.applied[e.Stamp.Key]) == 0 { // it dedupes by key
				rw.applied[e.Stamp.Key] = append(rw.applied[e.Stamp.Key], string(e.Data))
			} else {
				rw.applied[e.Stamp.Key] = append(rw.applied[e.Stamp.Key], "again: "+string(e.Data))
			}
			rw.poke()
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	runTestSink(t, r)
	rw.runner = r
	return rw
}

// producer enqueues on the world's job stream.
func (rw *replayWorld) producer(t *testing.T) *worker.Producer {
	t.Helper()
	p, err := worker.NewProducer(rw.js, worker.ProducerConfig{Prefix: rw.prefix, Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// enqueueN enqueues n jobs with p, "job 0" under key "k0" and on.
func enqueueN(t *testing.T, ctx context.Context, p *worker.Producer, n int) []worker.Enqueued {
	t.Helper()
	var jobs []worker.Enqueued
	for i := range n {
		e, err := p.Enqueue(ctx, []byte(fmt.Sprintf("k%d", i)), []byte(fmt.Sprintf("job %d", i)))
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, e)
	}
	return jobs
}

func (rw *replayWorld) poke() {
	select {
	case rw.notify <- struct{}{}:
	default:
	}
}

// startWorker runs a worker named id with handler h until the returned
// function stops it (gracefully: it drains, commits and releases).
func (rw *replayWorld) startWorker(t *testing.T, id string, maxAttempts int, h worker.HandlerFunc) (*progress, func()) {
	t.Helper()
	prog := newProgress()
	w, err := worker.New(worker.Config{
		JetStream: rw.js, Prefix: rw.prefix, Partitions: 1, Bucket: rw.bucket, MaxAttempts: maxAttempts, Handler: h,
		PartitionConcurrency: 8,
		Coordinator:          coordinator.Config{Worker: id, TTL: 2 * time.Second, Logger: rw.quiet},
		Observer:             prog,
		Logger:               rw.quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(wctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-stopped; err != nil {
				t.Errorf("worker %s: %v", id, err)
			}
		})
	}
	t.Cleanup(stop)
	return prog, stop
}

// settle waits until the runner has decided the whole effect log.
func (rw *replayWorld) settle(t *testing.T, ctx context.Context) {
	t.Helper()
	waitSinkSettled(t, ctx, rw.js, rw.prefix, rw.runner)
}

// replayAtSink runs `leasehold dlq replay --all --sink`, wants its output
// to say want (what names the run in a failure), and waits until the
// runner has decided what the replay put in the effect log.
func (rw *replayWorld) replayAtSink(t *testing.T, ctx context.Context, what, want string) {
	t.Helper()
	out := mustRun(t, ctx, "dlq", "replay", "--all", "--sink", "--nats", rw.url, "--prefix", rw.prefix)
	t.Logf("dlq replay --all --sink:\n%s", out)
	wantIn(t, what, out, want)
	rw.settle(t, ctx)
}

// waitDecided waits until the runner has made a decision on key that
// matches want.
func (rw *replayWorld) waitDecided(t *testing.T, ctx context.Context, key string, want func(sink.Decision) bool) sink.Decision {
	t.Helper()
	for {
		rw.mu.Lock()
		for _, d := range rw.decided[key] {
			if want(d) {
				rw.mu.Unlock()
				return d
			}
		}
		rw.mu.Unlock()
		select {
		case <-rw.notify:
		case <-ctx.Done():
			t.Fatalf("no awaited decision on %s: %v", key, rw.decisionsOf(key))
		}
	}
}

func (rw *replayWorld) decisionsOf(key string) []string {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	var out []string
	for _, d := range rw.decided[key] {
		s := fmt.Sprintf("%v at %d", d.Outcome, d.Position)
		if d.Suspect != "" {
			s += " suspect " + d.Suspect
		}
		if d.Err != nil {
			s += fmt.Sprintf(" (%v)", d.Err)
		}
		out = append(out, s)
	}
	return out
}

// refusedFor returns a decision on key that refuses it for good: stale,
// split brain, unverified, malformed, or set aside as suspicious.
func (rw *replayWorld) refusedFor(key string) (sink.Decision, bool) {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	for _, d := range rw.decided[key] {
		switch {
		case d.Outcome == sink.Stale, d.Outcome == sink.SplitBrain, d.Outcome == sink.Unverified, d.Outcome == sink.BadStamp,
			d.Outcome == sink.Aborted && d.Suspect != "":
			return d, true
		}
	}
	return sink.Decision{}, false
}

// wantOnce fails unless key was applied exactly once, waiting for it
// until the runner has decided something final about it.
func (rw *replayWorld) wantOnce(t *testing.T, ctx context.Context, key, what string) {
	t.Helper()
	for {
		rw.mu.Lock()
		n := len(rw.applied[key])
		rw.mu.Unlock()
		if n > 0 {
			break
		}
		if d, ok := rw.refusedFor(key); ok {
			t.Errorf("LOST: %s: its effect %s is refused for good (%v, suspect %q: %v); the runner's decisions on that key: %v", what, key, d.Outcome, d.Suspect, d.Err, rw.decisionsOf(key))
			return
		}
		select {
		case <-rw.notify:
		case <-ctx.Done():
			t.Errorf("LOST: %s: its effect %s was never applied; the runner's decisions on that key: %v", what, key, rw.decisionsOf(key))
			return
		}
	}
	rw.mu.Lock()
	defer rw.mu.Unlock()
	if got := rw.applied[key]; len(got) != 1 {
		t.Errorf("%s: effect %s delivered %d times (%q), want once", what, key, len(got), got)
	}
}

// sinkDeadLetters waits until the sink's dead-letter stream holds n.
func (rw *replayWorld) sinkDeadLetters(t *testing.T, ctx context.Context, n uint64) {
	t.Helper()
	for {
		st, err := rw.js.Stream(ctx, rw.prefix+"-sink-dlq")
		if err == nil {
			if info, err := st.Info(ctx); err == nil && info.State.Msgs >= n {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the sink's dead-letter stream never held %d dead letters", n)
		case <-rw.notify:
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// A job whose handler emits an effect with Job.Emit fails its one attempt
// and is dead-lettered by the worker; the operator fixes the cause and runs
// `leasehold dlq replay --all`. The replay keeps the job's identity, so
// its effect carries the key of the job's first place; the worker runs it,
// it succeeds, and the worker commits it. The stream sink runner must
// apply that effect once: the replayed job is committed.
func TestAttackJobReplayEffectReachesStreamSink(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rw := newReplayWorld(t, ctx, "rj")
	var failing atomic.Bool
	failing.Store(true)
	prog, _ := rw.startWorker(t, "w", 1, func(ctx context.Context, j *worker.Job) error {
		if err := j.Emit(ctx, []byte(fmt.Sprintf("credit of %s", j.Data))); err != nil {
			return err
		}
		if failing.Load() && string(j.Data) == "doomed" {
			return errors.New("the ledger is closed for the night")
		}
		return nil
	})
	p, err := worker.NewProducer(rw.js, worker.ProducerConfig{Prefix: rw.prefix, Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	doomed, err := p.Enqueue(ctx, []byte("a"), []byte("doomed"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := p.Enqueue(ctx, []byte("b"), []byte("other"))
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 0, other.Seq)
	failing.Store(false)
	out := mustRun(t, ctx, "dlq", "replay", "--all", "--nats", rw.url, "--prefix", rw.prefix)
	t.Logf("dlq replay --all:\n%s", out)
	replay := replayedSeq(t, out)
	prog.wait(t, ctx, 0, replay)
	rw.settle(t, ctx)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	rw.wantOnce(t, wctx, leasehold.EffectKey(rw.prefix, 0, other.Seq, 0), "a job beside the dead-lettered one")
	rw.wantOnce(t, wctx, leasehold.EffectKey(rw.prefix, 0, doomed.Seq, 0), fmt.Sprintf("job %d, dead-lettered, replayed as job %d and committed", doomed.Seq, replay))
}

// Jobs of eight keys run side by side; the destination refuses the effect
// of every job as poison, so each goes to the sink's dead-letter stream
// after the worker committed it. The partition then changes hands (a
// deploy: the worker stops gracefully and another takes over, raising the
// fence). The operator fixes the destination and runs `leasehold dlq
// replay --all --sink`, as its help says. The replays are stale now:
// applied, they could overwrite what the new holder wrote. None may be
// applied, and none lost: each goes back to the sink's dead-letter stream
// saying why, for the operator to decide.
func TestAttackSinkReplayAfterHandOff(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rw := newReplayWorld(t, ctx, "rh")
	rw.refusing.Store(true)
	emit := func(ctx context.Context, j *worker.Job) error {
		return j.Emit(ctx, []byte(fmt.Sprintf("credit of %s", j.Data)))
	}
	prog, stop := rw.startWorker(t, "w1", 5, emit)
	p := rw.producer(t)
	const n = 8
	jobs := enqueueN(t, ctx, p, n)
	prog.wait(t, ctx, 0, jobs[n-1].Seq)
	rw.sinkDeadLetters(t, ctx, n)
	stop()
	prog2, _ := rw.startWorker(t, "w2", 5, emit)
	// The new holder's first job: once it applies, the runner's fence has
	// risen to the new lease.
	rw.refusing.Store(false)
	marker, err := p.Enqueue(ctx, []byte("k-next"), []byte("next"))
	if err != nil {
		t.Fatal(err)
	}
	prog2.wait(t, ctx, 0, marker.Seq)
	rw.wantOnce(t, ctx, leasehold.EffectKey(rw.prefix, 0, marker.Seq, 0), "the new holder's job")

	rw.replayAtSink(t, ctx, "replay", fmt.Sprintf("%d replayed", n))
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for _, e := range jobs {
		key := leasehold.EffectKey(rw.prefix, 0, e.Seq, 0)
		d := rw.waitDecided(t, wctx, key, func(d sink.Decision) bool {
			return d.Outcome == sink.DeadLettered && d.Err != nil && strings.Contains(d.Err.Error(), "replay")
		})
		if !strings.Contains(d.Err.Error(), "stale") {
			t.Errorf("job %d: the replay went back to the dead-letter stream without saying it was stale: %v", e.Seq, d.Err)
		}
		rw.mu.Lock()
		if got := rw.applied[key]; len(got) != 0 {
			t.Errorf("job %d: its effect, stale since the hand-off, was applied %d times", e.Seq, len(got))
		}
		rw.mu.Unlock()
	}
	// Nothing lost: every dead letter is back, with its error.
	rw.sinkDeadLetters(t, wctx, n)
	out := mustRun(t, ctx, "dlq", "list", "--sink", "--nats", rw.url, "--prefix", rw.prefix)
	if c := strings.Count(out, "stale"); c < n {
		t.Errorf("dlq list --sink names %d stale replays, want %d:\n%s", c, n, out)
	}
}

// The same with the partition still in the first holder's hands, and the
// jobs completing out of order (eight keys side by side): each replayed
// effect applies once, and a second `dlq replay --all --sink` finds
// nothing left to send.
func TestAttackSinkReplayOutOfOrderSameLease(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rw := newReplayWorld(t, ctx, "ro")
	rw.refusing.Store(true)
	release := make(chan struct{})
	var relOnce sync.Once
	t.Cleanup(func() { relOnce.Do(func() { close(release) }) })
	prog, _ := rw.startWorker(t, "w1", 5, func(ctx context.Context, j *worker.Job) error {
		if string(j.Data) == "job 0" {
			// The first job completes last.
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return j.Emit(ctx, []byte(fmt.Sprintf("credit of %s", j.Data)))
	})
	const n = 8
	jobs := enqueueN(t, ctx, rw.producer(t), n)
	rw.sinkDeadLetters(t, ctx, n-1)
	relOnce.Do(func() { close(release) })
	prog.wait(t, ctx, 0, jobs[n-1].Seq)
	rw.sinkDeadLetters(t, ctx, n)
	rw.refusing.Store(false)
	rw.replayAtSink(t, ctx, "replay", fmt.Sprintf("%d replayed", n))
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for _, e := range jobs {
		rw.wantOnce(t, wctx, leasehold.EffectKey(rw.prefix, 0, e.Seq, 0), fmt.Sprintf("job %d, completed out of order, dead-lettered at the sink and replayed", e.Seq))
	}
	rw.replayAtSink(t, ctx, "second replay", "0 replayed")
	for _, e := range jobs {
		rw.wantOnce(t, wctx, leasehold.EffectKey(rw.prefix, 0, e.Seq, 0), "after a second replay")
	}
}
