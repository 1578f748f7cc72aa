package worker_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Only leasehold's tools write a job's origin and its other Leasehold-*
// headers: a producer refuses them from its caller, however spelled, so
// that no job emits another job's keys through the SDK. Leasehold-Kind
// alone may be given. Enqueue used to copy them onto the job.
func TestProducerRefusesLeaseholdHeaders(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 30*time.Second)
	p := e.producer(t)
	for _, name := range []string{"Leasehold-Origin", "leasehold-origin", "Leasehold-Replay-Of", "Leasehold-Key", "LEASEHOLD-JOB", "Leasehold-Seq"} {
		_, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.WithHeader(nats.Header{name: {"jobs/0/1"}}))
		if err == nil || !strings.Contains(err.Error(), "is leasehold's own") {
			t.Errorf("an enqueue with header %s: %v; want it refused", name, err)
		}
		b := p.Batch()
		if err := b.EnqueueTo(ctx, 0, []byte("x"), worker.WithHeader(nats.Header{name: {"jobs/0/1"}})); err == nil {
			t.Errorf("a batch enqueue with header %s was taken", name)
		}
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.WithHeader(nats.Header{"Leasehold-Kind": {"email"}, "X-Order": {"7"}})); err != nil {
		t.Errorf("an enqueue with Leasehold-Kind: %v", err)
	}
}

// A job whose Leasehold-Origin cannot be read is dead-lettered at once,
// saying why, before its handler runs: run under its place's keys, it
// would apply again what it applied at its origin. Its dead letter names
// its place as its origin. A job stored with a readable origin (as a
// replay or a move stores it) emits its origin's keys, and so do its abort
// markers, and its dead letter carries that origin on. A job whose origin
// lies in its own partition after its place is forged (a job is stored
// again only after it was stored first): it is dead-lettered at once too,
// under its place, rather than take the keys of a job still to come.
func TestJobOriginDecidesItsKeys(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	var mu sync.Mutex
	var ran []string
	failed := make(chan *worker.Job, 4)
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		ran = append(ran, string(j.Data))
		mu.Unlock()
		// Two effects: the first leaves before the handler returns, so
		// the failure is closed by an abort marker.
		if err := j.Emit(ctx, []byte("a")); err != nil {
			return err
		}
		if err := j.Emit(ctx, []byte("b")); err != nil {
			return err
		}
		failed <- j
		return errors.New("the bank said no")
	}))
	cfg.MaxAttempts = 1
	rec := newRecorder()
	cfg.Observer = rec
	start(t, cfg)
	publish := func(data string, origins ...string) uint64 {
		t.Helper()
		msg := nats.NewMsg(worker.JobSubject(e.prefix, 0))
		msg.Data = []byte(data)
		for _, o := range origins {
			msg.Header.Add(leasehold.HeaderOrigin, o)
		}
		ack, err := e.js.PublishMsg(ctx, msg)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	garbled := publish("garbled", "jobs/0/007")
	twice := publish("twice", "jobs/0/7", "jobs/0/8")
	moved := publish("moved", "old/0/77")
	ahead := publish("ahead", "jobs/0/1000")
	rec.waitFor(t, 30*time.Second, "four dead letters", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) == 4 })
	mu.Lock()
	if len(ran) != 1 || ran[0] != "moved" {
		t.Errorf("handlers ran for %v; want only the job whose origin can be read", ran)
	}
	mu.Unlock()
	j := <-failed
	if j.Origin() != leasehold.OriginOf("old", 0, 77) {
		t.Errorf("the moved job's origin is %s", j.Origin())
	}

	dead := map[string]jetstream.Msg{}
	for _, m := range readStream(t, e.js, worker.DLQStream(e.prefix)) {
		dead[m.Headers().Get(worker.HeaderSeq)] = m
	}
	for seq, want := range map[uint64][]string{garbled: {"Leasehold-Origin", `"jobs/0/007"`, "leading zero"}, twice: {"Leasehold-Origin", "more than once"},
		ahead: {"Leasehold-Origin", `"jobs/0/1000"`, "at or after the job's place"}} {
		m := dead[itoa(seq)]
		if m == nil {
			t.Fatalf("no dead letter for job %d", seq)
		}
		reason := m.Headers().Get(worker.HeaderError)
		for _, w := range want {
			if !strings.Contains(reason, w) {
				t.Errorf("dead letter of job %d says %q; want it to say %q", seq, reason, w)
			}
		}
		if o := m.Headers().Get(leasehold.HeaderOrigin); o != leasehold.OriginOf(e.prefix, 0, seq).String() {
			t.Errorf("dead letter of job %d names origin %q; want its place", seq, o)
		}
	}
	if o := dead[itoa(moved)].Headers().Get(leasehold.HeaderOrigin); o != "old/0/77" {
		t.Errorf("the moved job's dead letter names origin %q, want old/0/77", o)
	}

	var keys []string
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		if !isBarrier(m) {
			keys = append(keys, stampOf(t, m).Key)
		}
	}
	want := []string{leasehold.EffectKey("old", 0, 77, 0), worker.AbortKey("old", 0, 77, uint64(j.Attempt))}
	if len(keys) != 2 || keys[0] != want[0] || !strings.HasPrefix(keys[1], "old.0.77.abort.") {
		t.Errorf("the moved job wrote keys %v; want its origin's %v", keys, want)
	}
}

func itoa(n uint64) string { return strconv.FormatUint(n, 10) }
