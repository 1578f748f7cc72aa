package worker_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A publisher that stores garbage under the message IDs a worker would use
// for its next effects (the idempotency key and the epoch: all it can know
// in advance) cannot make those effects vanish: each attempt's IDs carry a
// nonce nobody knows before the attempt runs, so every real effect is
// stored and every job committed has its effect in the log.
func TestPreemptedMessageIDsCannotHideEffects(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the partition's barrier", func() bool {
		return rec.count(kind(worker.EventPartitionReady)) > 0
	})
	lease := rec.all()[0].Lease
	s, err := e.js.Stream(ctxFor(t, 10*time.Second), worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	last := s.CachedInfo().State.LastSeq
	const n = 16
	for i := range uint64(n) {
		key := leasehold.EffectKey(e.prefix, 0, last+1+i, 0)
		for _, id := range []string{key + "@" + lease.Epoch.String(), key, worker.MessageID(lease.Stamp(key), "")} {
			msg := nats.NewMsg(worker.OutputSubject(e.prefix, 0))
			msg.Data = []byte("garbage")
			msg.Header.Set(jetstream.MsgIDHeader, id)
			if _, err := e.js.PublishMsg(ctxFor(t, 10*time.Second), msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	enq := e.enqueue(t, 0, n)
	rec.waitCommitted(t, 30*time.Second, enq[n-1].Seq)
	stored := map[string]string{}
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		if k := keyOf(m.Headers()); k != "" && m.Headers().Get(leasehold.HeaderBarrier) == "" {
			stored[k] = string(m.Data())
		}
	}
	for i, q := range enq {
		key := leasehold.EffectKey(e.prefix, 0, q.Seq, 0)
		if got, want := stored[key], fmt.Sprintf("key-%d", i); got != want {
			t.Errorf("job %d committed, its effect %s in the log holds %q, want %q", q.Seq, key, got, want)
		}
	}
	if n := rec.count(kind(worker.EventJobFailed)); n != 0 {
		t.Errorf("%d attempts failed; the forged messages should not have touched any", n)
	}
}

// An effect that a sink could not store, once it adds its own headers, is
// refused where it is made, with an error that names the limit; the job is
// dead-lettered at once (retrying a deterministic handler cannot help) and
// the partition goes on.
func TestEffectTooLargeIsDeadLettered(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	var emitErr error
	enq := e.enqueue(t, 0, 3)
	max := e.js.Conn().MaxPayload()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq == enq[1].Seq {
			// Fits the server's limit, but not with a sink's headers added.
			emitErr = j.Emit(ctx, make([]byte, max-leasehold.SinkHeaderRoom/2))
			return emitErr
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	start(t, cfg)
	rec.waitCommitted(t, 30*time.Second, enq[2].Seq)
	if !errors.Is(emitErr, worker.ErrEffectTooLarge) || !strings.Contains(emitErr.Error(), "max payload") {
		t.Fatalf("Emit of an oversized effect = %v, want ErrEffectTooLarge naming the limit", emitErr)
	}
	if n := rec.count(kind(worker.EventJobFailed)); n != 1 {
		t.Errorf("%d failed attempts, want 1: the oversized effect is permanent", n)
	}
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 || !strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "too large") {
		t.Fatalf("dead letters %d, want 1 that says the effect was too large", len(dlq))
	}
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		if len(m.Data()) > 1000 {
			t.Fatalf("an oversized effect of %d bytes reached the log", len(m.Data()))
		}
	}
}

// An effect subject no stream listens on fails for ever; once such
// failures have gone on for TransientFor they count as attempts, and the
// job ends in the dead-letter stream instead of holding its partition.
func TestEffectWithoutStreamIsDeadLettered(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	enq := e.enqueue(t, 0, 3)
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq == enq[1].Seq {
			if err := j.Publish(ctx, "nowhere.at.all", j.Data); err != nil {
				return err
			}
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	cfg.MaxAttempts = 3
	cfg.TransientFor = 200 * time.Millisecond
	cfg.EffectTimeout = 500 * time.Millisecond
	start(t, cfg)
	rec.waitCommitted(t, time.Minute, enq[2].Seq)
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 || dlq[0].Headers().Get(worker.HeaderSeq) != strconv.FormatUint(enq[1].Seq, 10) {
		t.Fatalf("dead letters %d, want the job whose effect had nowhere to go", len(dlq))
	}
	if !strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "nowhere.at.all") {
		t.Errorf("the dead letter's error %q does not name the subject", dlq[0].Headers().Get(worker.HeaderError))
	}
}

// A handler that never returns stalls its partition: after StallAfter the
// worker says so in Ready (the command's /readyz), and says it no more
// once the partition moves again.
func TestStalledPartitionFailsReady(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	release := make(chan struct{})
	enq := e.enqueue(t, 0, 2)
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq == enq[0].Seq {
			<-release
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	cfg.StallAfter = 300 * time.Millisecond
	r := start(t, cfg)
	rec.waitFor(t, 30*time.Second, "Ready to report the stalled partition", func() bool {
		err := r.w.Ready(context.Background())
		return err != nil && strings.Contains(err.Error(), "0 (at job 0")
	})
	if st := r.w.Stalled(); len(st) != 1 || st[0].Partition != 0 || st[0].Committed != 0 {
		t.Fatalf("Stalled() = %+v, want partition 0 at progress 0", st)
	}
	close(release)
	rec.waitFor(t, 30*time.Second, "Ready once the partition moved again", func() bool {
		return r.w.Ready(context.Background()) == nil
	})
}

// A job stream without a default output and the default barriers cannot
// work: the worker says so at start instead of retrying a barrier for ever.
func TestNoEffectsWithDefaultBarriersFailsAtStart(t *testing.T) {
	srv := natstestStart(t)
	js := srv.JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "quiet", Partitions: 1, NoEffects: true}); err != nil {
		t.Fatal(err)
	}
	e := &env{srv: srv, js: js, prefix: "quiet", n: 1}
	e.bucket = e.provisionBucket(t)
	w, err := worker.New(e.config("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil })))
	if err != nil {
		t.Fatal(err)
	}
	err = w.Run(ctx)
	if !errors.Is(err, worker.ErrStreamConfig) || !strings.Contains(err.Error(), "BarrierSubjects") {
		t.Fatalf("Run = %v, want an error at start that says to set BarrierSubjects", err)
	}
}
