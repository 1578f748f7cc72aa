package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// replayedSeq reads the job stream sequence a `dlq replay` of one dead
// letter printed.
func replayedSeq(t *testing.T, out string) uint64 {
	t.Helper()
	_, rest, ok := strings.Cut(out, "-jobs sequence ")
	if !ok {
		t.Fatalf("no job stream sequence in the replay's output:\n%s", out)
	}
	end := strings.IndexAny(rest, ");,")
	seq, err := strconv.ParseUint(rest[:end], 10, 64)
	if err != nil {
		t.Fatalf("replay output %q: %v", out, err)
	}
	return seq
}

// A job applies a charge to a sink that dedupes by key, then fails every
// attempt and is dead-lettered. Replayed, it succeeds: the sink holds one
// charge, not two, since the replay keeps the job's identity and so its
// keys. The same holds for the job stored again on another partition with
// its origin, as a tool that moves jobs would, and for a dead letter
// written before origins were (its job's place is its origin). Keys used
// to derive from the replay's new sequence: two charges under two keys.
func TestDlqReplayKeepsTheJobsKeys(t *testing.T) {
	s, ctx := initialized(t, 90*time.Second, "--prefix", "ch", "--partitions", "2")
	js := s.JetStream(t)
	charges := sink.NewMemory(sink.MemoryConfig{KeepLog: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	var failing atomic.Bool
	failing.Store(true)
	keys := make(chan string, 16)
	prog := runDLQWorker(t, ctx, js, "ch", 2, func(ctx context.Context, j *worker.Job) error {
		stamp := make(chan string, 1)
		err := j.Apply(ctx, observed{charges, stamp}, "charges", j.Data)
		keys <- <-stamp
		if err != nil {
			return err
		}
		if failing.Load() {
			return errors.New("the receipt printer is out of paper")
		}
		return nil
	})
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "ch", Partitions: 2})
	if err != nil {
		t.Fatal(err)
	}
	e, err := p.EnqueueTo(ctx, 0, []byte("charge 10 EUR"))
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 0, e.Seq)
	first := <-keys
	if want := leasehold.EffectKey("ch", 0, e.Seq, 0); first != want {
		t.Fatalf("the job's first run applied key %s, want %s: a job that never moved keeps the key scheme it always had", first, want)
	}
	conn := []string{"--nats", s.URL(), "--prefix", "ch"}
	count := func(what string) {
		t.Helper()
		if n := len(charges.Applied()); n != 1 {
			t.Errorf("%s: the sink holds %d charges, want 1: %v", what, n, charges.Applied())
		}
	}

	// The replay succeeds.
	failing.Store(false)
	out := mustRun(t, ctx, append([]string{"dlq", "replay", "1"}, conn...)...)
	t.Logf("dlq replay 1:\n%s", out)
	replay := replayedSeq(t, out)
	prog.wait(t, ctx, 0, replay)
	if got := <-keys; got != first {
		t.Errorf("the replay applied key %s, want the job's %s", got, first)
	}
	count("after the replay")

	// Stored again on another partition, with its origin.
	msg := nats.NewMsg(worker.JobSubject("ch", 1))
	msg.Data = []byte("charge 10 EUR")
	leasehold.OriginOf("ch", 0, e.Seq).SetHeader(msg.Header)
	ack, err := js.PublishMsg(ctx, msg)
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 1, ack.Sequence)
	if got := <-keys; got != first {
		t.Errorf("the job moved to partition 1 applied key %s, want the job's %s", got, first)
	}
	count("after the move")

	// A dead letter the previous release wrote has no Leasehold-Origin:
	// its job's place is its origin.
	failing.Store(true)
	e2, err := p.EnqueueTo(ctx, 1, []byte("charge 20 EUR"))
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 1, e2.Seq)
	second := <-keys
	dlq, err := js.Stream(ctx, worker.DLQStream("ch"))
	if err != nil {
		t.Fatal(err)
	}
	dl, err := dlq.GetLastMsgForSubject(ctx, worker.DLQSubject("ch", 1))
	if err != nil {
		t.Fatal(err)
	}
	old := nats.NewMsg(dl.Subject)
	old.Data = dl.Data
	for k, vs := range dl.Header {
		if k != leasehold.HeaderOrigin && k != jetstream.MsgIDHeader {
			old.Header[k] = vs
		}
	}
	oldAck, err := js.PublishMsg(ctx, old)
	if err != nil {
		t.Fatal(err)
	}
	if err := dlq.DeleteMsg(ctx, dl.Sequence); err != nil {
		t.Fatal(err)
	}
	failing.Store(false)
	out = mustRun(t, ctx, append([]string{"dlq", "replay", strconv.FormatUint(oldAck.Sequence, 10)}, conn...)...)
	t.Logf("dlq replay of a dead letter without an origin:\n%s", out)
	prog.wait(t, ctx, 1, replayedSeq(t, out))
	if got := <-keys; got != second || got != leasehold.EffectKey("ch", 1, e2.Seq, 0) {
		t.Errorf("the replay of a dead letter without an origin applied key %s, want its job's %s", got, second)
	}
	if n := len(charges.Applied()); n != 2 {
		t.Errorf("the sink holds %d charges for two jobs: %v", n, charges.Applied())
	}
}

// observed is a sink that tells the key of the effect it is handed.
type observed struct {
	sink.Sink
	key chan<- string
}

func (o observed) Apply(ctx context.Context, effects ...sink.Effect) error {
	o.key <- effects[0].Stamp.Key
	return o.Sink.Apply(ctx, effects...)
}

// A worker commits a job whose one effect was emitted with Job.Emit; the
// stream sink's handler refuses it once (ErrPoison), so it goes to the
// sink's dead-letter stream. `dlq replay --all --sink` sends it back alone,
// with its stamp and not its job's headers, and the runner applies it
// once. The replay used to carry Leasehold-Job, -Attempt, -Effects and
// -After, and the runner dropped it as a job it had applied: applied 0
// times, and the dead letter deleted.
func TestDlqSinkReplayIsAppliedOnce(t *testing.T) {
	s, ctx := initialized(t, 90*time.Second, "--prefix", "sk", "--partitions", "1")
	js := s.JetStream(t)
	var (
		mu      sync.Mutex
		applied = map[string]int{}
		refused = map[string]bool{}
		seen    = make(chan string, 16)
	)
	r, err := streamsink.New(ctx, js, streamsink.Config{
		Prefix: "sk", Name: "ledger", FetchWait: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: func(_ context.Context, e sink.Effect) error {
			mu.Lock()
			defer mu.Unlock()
			if !refused[e.Stamp.Key] && e.Stamp.Key != "sentinel" {
				refused[e.Stamp.Key] = true
				return fmt.Errorf("%w: the ledger is closed for the night", streamsink.ErrPoison)
			}
			applied[e.Stamp.Key]++
			seen <- e.Stamp.Key
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	runTestSink(t, r)
	var lease leasehold.Lease
	var once sync.Once
	prog := runDLQWorker(t, ctx, js, "sk", 1, func(ctx context.Context, j *worker.Job) error {
		once.Do(func() { lease = j.Lease })
		return j.Emit(ctx, []byte("credit 5"))
	})
	e := enqueueDone(t, ctx, js, "sk", 1, prog, []byte("job"))
	key := leasehold.EffectKey("sk", 0, e.Seq, 0)
	sinkDLQ := func() (jetstream.Stream, *jetstream.StreamState) {
		t.Helper()
		for {
			st, err := js.Stream(ctx, "sk-sink-dlq")
			if err == nil && st.CachedInfo().State.Msgs > 0 {
				return st, &st.CachedInfo().State
			}
			select {
			case <-ctx.Done():
				t.Fatalf("the refused effect never reached the sink's dead-letter stream (%v)", err)
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	dlqStream, _ := sinkDLQ()

	out := mustRun(t, ctx, "dlq", "replay", "--all", "--sink", "--nats", s.URL(), "--prefix", "sk")
	t.Logf("dlq replay --all --sink:\n%s", out)
	wantIn(t, "replay", out, "replayed 1 to sk.out.0", "1 replayed")
	effects, err := js.Stream(ctx, worker.EffectsStream("sk"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := effects.GetLastMsgForSubject(ctx, worker.OutputSubject("sk", 0))
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{leasehold.HeaderJob, leasehold.HeaderAttempt, leasehold.HeaderEffects, leasehold.HeaderAfter, leasehold.HeaderAbort} {
		if v := m.Header.Get(h); v != "" {
			t.Errorf("the replayed effect carries %s: %s", h, v)
		}
	}
	if got := m.Header.Get(leasehold.HeaderReplayOf); got != "sk-sink-dlq/1" {
		t.Errorf("the replayed effect's %s is %q, want sk-sink-dlq/1", leasehold.HeaderReplayOf, got)
	}
	if got := m.Header.Get(leasehold.HeaderReplayReason); !strings.Contains(got, "the ledger is closed for the night") {
		t.Errorf("the replayed effect's %s is %q", leasehold.HeaderReplayReason, got)
	}

	// A standalone effect after the replay, in the same lease: once the
	// runner has applied it, it has decided the replay.
	sentinel := nats.NewMsg(worker.OutputSubject("sk", 0))
	lease.Stamp("sentinel").SetHeader(sentinel.Header)
	if _, err := js.PublishMsg(ctx, sentinel); err != nil {
		t.Fatal(err)
	}
	for got := ""; got != "sentinel"; {
		select {
		case got = <-seen:
		case <-ctx.Done():
			t.Fatal("the runner never applied the effect published after the replay")
		}
	}
	mu.Lock()
	n := applied[key]
	mu.Unlock()
	info, err := dlqStream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || info.State.Msgs != 0 {
		t.Fatalf("the replayed effect %s was applied %d times, and %d dead letters are left; want once and none", key, n, info.State.Msgs)
	}
}

// A job's status follows it through the dead-letter tools. A job replayed
// while its cause is still there fails again; another is purged. `jobs
// show` says "replayed as <ref>" and "purged" of them, and `jobs wait`
// follows the replay to its dead letter and fails: neither is ever done.
// Both used to be reported done, since their dead letters were gone and
// the partition's progress had passed them.
func TestJobsStatusFollowsReplaysAndPurges(t *testing.T) {
	s, ctx := initialized(t, 90*time.Second, "--prefix", "fo", "--partitions", "1")
	js := s.JetStream(t)
	prog := runDLQWorker(t, ctx, js, "fo", 1, func(context.Context, *worker.Job) error {
		return errors.New("the warehouse is on fire")
	})
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "fo", Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, data := range []string{"replay me", "purge me"} {
		e, err := p.EnqueueTo(ctx, 0, []byte(data))
		if err != nil {
			t.Fatal(err)
		}
		prog.wait(t, ctx, 0, e.Seq)
		refs = append(refs, e.Ref())
	}
	conn := []string{"--nats", s.URL(), "--prefix", "fo"}
	out := mustRun(t, ctx, append([]string{"dlq", "replay", "1"}, conn...)...)
	replay := replayedSeq(t, out)
	prog.wait(t, ctx, 0, replay) // dead-lettered again
	replayRef := worker.Enqueued{Partition: 0, Seq: replay}.Ref()
	mustRun(t, ctx, append([]string{"dlq", "purge", "2", "--yes"}, conn...)...)

	out = mustRun(t, ctx, append(append([]string{"jobs", "show"}, append(refs, replayRef)...), conn...)...)
	t.Logf("jobs show:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 {
		t.Fatalf("jobs show printed %d lines", len(lines))
	}
	wantIn(t, "the replayed job", lines[1], refs[0], " replayed ", "replayed as "+replayRef, "the warehouse is on fire")
	wantIn(t, "the purged job", lines[2], refs[1], " purged ", "purged (dead letter 2: the warehouse is on fire)")
	wantIn(t, "the replay", lines[3], replayRef, " dead-lettered ")

	out, err = run(t, ctx, append(append([]string{"jobs", "wait", "--timeout", "30s"}, refs...), conn...)...)
	t.Logf("jobs wait: %v\n%s", err, out)
	if err == nil || !strings.Contains(err.Error(), "2 of 2 jobs did not succeed: 1 dead-lettered, 1 purged") {
		t.Errorf("jobs wait of a replayed and a purged job: %v; want it to fail saying so", err)
	}
	wantIn(t, "jobs wait", out, replayRef, "replay of "+refs[0], "dead-lettered", refs[1], "purged")
	if strings.Contains(out, " done ") {
		t.Errorf("jobs wait calls a job that never succeeded done:\n%s", out)
	}
}
