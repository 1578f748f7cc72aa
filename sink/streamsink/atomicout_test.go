package streamsink_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// republishing is a wireLog whose runner republishes into its downstream
// stream, "<scope>-fenced", with Config.AtomicJobs as atomic says.
func republishing(t *testing.T, scope string, atomic bool) *wireLog {
	wl := newWireLog(t, scope)
	wl.cfg.Handler = nil
	wl.cfg.AtomicJobs = atomic
	return wl
}

// With AtomicJobs, a job's effects on a subject reach the downstream
// stream in one atomic batch: a reader of that stream sees all of them or
// none. The runner creates the stream taking atomic batches; an effect of
// no job goes alone.
func TestRepublishedJobIsOneAtomicBatch(t *testing.T) {
	t.Parallel()
	wl := republishing(t, "atomout", true)
	r := start(t, wl.js, wl.cfg)
	wl.effect(10, 1, 0)
	wl.effect(10, 1, 1)
	f10 := wl.final(10, 1, 2, 0)
	s1 := wl.pub(1, "s1", leasehold.JobMark{}, false)
	wl.wait(r, max(f10, s1))

	ctx := ctxFor(t, 30*time.Second)
	s, err := wl.js.Stream(ctx, "atomout-fenced")
	if err != nil {
		t.Fatal(err)
	}
	if !s.CachedInfo().Config.AllowAtomicPublish {
		t.Error("the runner created its downstream stream without atomic publish")
	}
	msgs := readLog(t, wl.js, "atomout-fenced")
	batches := map[string][]string{}
	for _, m := range msgs {
		st, err := leasehold.StampFromHeader(m.Header)
		if err != nil {
			t.Fatalf("downstream message %d: %v", m.Sequence, err)
		}
		batches[m.Header.Get("Nats-Batch-Id")] = append(batches[m.Header.Get("Nats-Batch-Id")], st.Key)
	}
	if len(msgs) != 4 {
		t.Fatalf("the downstream stream holds %d messages, want 4 (the job's three and s1)", len(msgs))
	}
	if alone := batches[""]; len(alone) != 1 || alone[0] != "s1" {
		t.Errorf("outside any batch: %v, want s1 alone", alone)
	}
	delete(batches, "")
	if len(batches) != 1 {
		t.Fatalf("batches %v: want one, of the job's three effects", batches)
	}
	for id, keys := range batches {
		want := []string{wl.key(10, 0), wl.key(10, 1), wl.key(10, 2)}
		if len(keys) != 3 || keys[0] != want[0] || keys[1] != want[1] || keys[2] != want[2] {
			t.Errorf("batch %s holds %v, want %v in order", id, keys, want)
		}
	}
}

// Without AtomicJobs a job's effects go one by one, as before, and the
// downstream stream the runner creates takes no atomic batches.
func TestRepublishedJobWithoutAtomicJobs(t *testing.T) {
	t.Parallel()
	wl := republishing(t, "noatom", false)
	r := start(t, wl.js, wl.cfg)
	wl.effect(10, 1, 0)
	wl.effect(10, 1, 1)
	f10 := wl.final(10, 1, 2, 0)
	wl.wait(r, f10)
	s, err := wl.js.Stream(ctxFor(t, 30*time.Second), "noatom-fenced")
	if err != nil {
		t.Fatal(err)
	}
	if s.CachedInfo().Config.AllowAtomicPublish {
		t.Error("the runner created its downstream stream taking atomic batches, without AtomicJobs")
	}
	msgs := readLog(t, wl.js, "noatom-fenced")
	if len(msgs) != 3 {
		t.Fatalf("the downstream stream holds %d messages, want the job's 3", len(msgs))
	}
	for _, m := range msgs {
		if id := m.Header.Get("Nats-Batch-Id"); id != "" {
			t.Errorf("message %d came in batch %s, without AtomicJobs", m.Sequence, id)
		}
	}
}

// AtomicJobs on a downstream stream that takes no atomic batches (made by
// its operator, or by an earlier release) is a clear error at New, not a
// runner that quietly writes jobs one by one; and it is for republishing
// only.
func TestAtomicJobsNeedsAnAtomicStream(t *testing.T) {
	t.Parallel()
	wl := republishing(t, "needatom", true)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := wl.js.CreateStream(ctx, jetstream.StreamConfig{Name: "needatom-fenced", Subjects: []string{"needatom.fenced.>"}, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	_, err := streamsink.New(ctx, wl.js, wl.cfg)
	if err == nil || !strings.Contains(err.Error(), "--allow-batch") {
		t.Errorf("New with AtomicJobs on a stream without atomic publish: %v, want an error saying how to allow it", err)
	}
	cfg := wl.cfg
	cfg.Handler = func(context.Context, sink.Effect) error { return nil }
	if err := cfg.Validate(); err == nil {
		t.Error("AtomicJobs with a Handler validates")
	}
}

// An effect of the job that the downstream stream holds already (a
// republish whose answer was lost, before a crash) makes the server refuse
// the job's batch as a duplicate: the runner publishes the job's effects
// one by one then, the message IDs settle which are stored, and each is
// in the stream once.
func TestRepublishedJobPartlyStoredGoesOneByOne(t *testing.T) {
	t.Parallel()
	wl := republishing(t, "partatom", true)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := wl.js.CreateStream(ctx, jetstream.StreamConfig{Name: "partatom-fenced", Subjects: []string{"partatom.fenced.>"}, Duplicates: time.Minute, AllowAtomicPublish: true}); err != nil {
		t.Fatal(err)
	}
	// Effect 1 of job 10, stored as the runner would have stored it.
	st := leasehold.Stamp{Scope: "partatom", Epoch: 1, Acquisition: "a1", Key: wl.key(10, 1), Worker: "w1"}
	h := nats.Header{}
	st.SetHeader(h)
	h.Set(jetstream.MsgIDHeader, streamsink.MessageID(st))
	if _, err := wl.js.PublishMsg(ctx, &nats.Msg{Subject: "partatom.fenced.0", Header: h, Data: []byte(st.Key)}); err != nil {
		t.Fatal(err)
	}
	r := start(t, wl.js, wl.cfg)
	wl.effect(10, 1, 0)
	e1 := wl.effect(10, 1, 1)
	f10 := wl.final(10, 1, 2, 0)
	wl.wait(r, f10)
	count := map[string]int{}
	for _, m := range readLog(t, wl.js, "partatom-fenced") {
		st, err := leasehold.StampFromHeader(m.Header)
		if err != nil {
			t.Fatalf("downstream message %d: %v", m.Sequence, err)
		}
		count[st.Key]++
	}
	for i := range 3 {
		if n := count[wl.key(10, i)]; n != 1 {
			t.Errorf("effect %s is in the downstream stream %d times, want once", wl.key(10, i), n)
		}
	}
	if len(count) != 3 {
		t.Errorf("the downstream stream holds %v, want the job's three effects", count)
	}
	wl.outcome(e1, sink.Duplicate)
}

// A job one effect of which fits in the log but not, with the sink's
// headers, in a republish fails its atomic batch; the job's effects then
// go one by one: that effect is dead-lettered for the max payload, as it
// is without AtomicJobs, and the job's other effect is stored.
func TestAtomicJobWithAnEffectTooLarge(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	nc := srv.Connect(t)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	const prefix = "bigatom"
	rec := &positions{}
	rr := start(t, js, streamsink.Config{Prefix: prefix, Provision: true, AtomicJobs: true, Observer: rec, Logger: quiet()})
	msg := func(key string, mark leasehold.JobMark, n int) *nats.Msg {
		m := nats.NewMsg(prefix + ".out.p0")
		leasehold.Stamp{Scope: prefix, Epoch: 1, Acquisition: "a1", Key: key, Worker: "w1"}.SetHeader(m.Header)
		mark.SetHeader(m.Header)
		m.Data = make([]byte, n)
		return m
	}
	lo := largestFit(t, nc, func(n int) *nats.Msg { return msg(prefix+".0.1.0", leasehold.JobMark{Job: 1, Attempt: 1}, n) })
	ack, err := js.PublishMsg(ctx, msg(prefix+".0.1.0", leasehold.JobMark{Job: 1, Attempt: 1}, lo))
	if err != nil {
		t.Fatal(err)
	}
	big := ack.Sequence
	if ack, err = js.PublishMsg(ctx, msg(prefix+".0.1.1", leasehold.JobMark{Job: 1, Attempt: 1, Effects: 2}, 10)); err != nil {
		t.Fatal(err)
	}
	final := ack.Sequence
	if err := rr.WaitPosition(ctx, final); err != nil {
		t.Fatal(err)
	}
	if d, _ := rec.at(big); d.Outcome != sink.DeadLettered || !errors.Is(d.Err, nats.ErrMaxPayload) {
		t.Errorf("the oversized effect: %v (%v), want dead_lettered for the max payload", d.Outcome, d.Err)
	}
	if d, _ := rec.at(final); d.Outcome != sink.Accepted {
		t.Errorf("the job's other effect: %v, want accepted", d.Outcome)
	}
	msgs := readLog(t, js, prefix+"-fenced")
	if len(msgs) != 1 {
		t.Fatalf("the downstream stream holds %d messages, want the job's small effect", len(msgs))
	}
	if id := msgs[0].Header.Get("Nats-Batch-Id"); id != "" {
		t.Errorf("the small effect came in batch %s, after the job's batch failed", id)
	}
}
