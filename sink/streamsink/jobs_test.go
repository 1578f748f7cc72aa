package streamsink_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

// wireLog publishes job effects by hand, as workers write them, into the
// log of a runner that hands what it applies to an appliedLog.
type wireLog struct {
	t       testing.TB
	js      jetstream.JetStream
	scope   string
	cfg     streamsink.Config
	applied *appliedLog
	rec     *positions
}

func newWireLog(t *testing.T, scope string) *wireLog {
	srv := natstest.Start(t)
	wl := &wireLog{t: t, js: srv.JetStream(t), scope: scope, applied: &appliedLog{}, rec: &positions{}}
	wl.cfg = streamsink.Config{Prefix: scope, Provision: true, Handler: wl.applied.handler, Observer: wl.rec, MaxBackoff: 10 * time.Millisecond}
	return wl
}

// pub publishes one message of partition 0 under epoch e and returns its
// log position. A zero mark is a standalone effect.
func (wl *wireLog) pub(e leasehold.Epoch, key string, mark leasehold.JobMark, barrier bool) uint64 {
	wl.t.Helper()
	h := nats.Header{}
	leasehold.Stamp{Scope: wl.scope, Epoch: e, Acquisition: fmt.Sprintf("a%d", e), Key: key, Worker: fmt.Sprintf("w%d", e)}.SetHeader(h)
	mark.SetHeader(h)
	if barrier {
		h.Set(leasehold.HeaderBarrier, "1")
	}
	var data []byte
	if !mark.Abort && !barrier {
		data = []byte(key)
	}
	ack, err := wl.js.PublishMsg(ctxFor(wl.t, 30*time.Second), &nats.Msg{Subject: wl.scope + ".out.0", Header: h, Data: data})
	if err != nil {
		wl.t.Fatalf("publish %s: %v", key, err)
	}
	return ack.Sequence
}

func (wl *wireLog) effect(job, attempt uint64, i int) uint64 {
	return wl.pub(1, wl.key(job, i), leasehold.JobMark{Job: job, Attempt: attempt}, false)
}

func (wl *wireLog) final(job, attempt uint64, i int, after uint64) uint64 {
	return wl.pub(1, wl.key(job, i), leasehold.JobMark{Job: job, Attempt: attempt, Effects: i + 1, After: after}, false)
}

func (wl *wireLog) key(job uint64, i int) string { return fmt.Sprintf("%s.0.%d.%d", wl.scope, job, i) }

func (wl *wireLog) wait(r *running, seq uint64) {
	wl.t.Helper()
	if err := r.WaitPosition(ctxFor(wl.t, time.Minute), seq); err != nil {
		wl.t.Fatal(err)
	}
}

// want checks what was applied, key by key, with how often.
func (wl *wireLog) want(want map[string]int) {
	wl.t.Helper()
	got := wl.applied.snapshot()
	for k, n := range want {
		if got[k] != n {
			wl.t.Errorf("effect %s applied %d times, want %d", k, got[k], n)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			wl.t.Errorf("effect %s applied %d times, want never", k, got[k])
		}
	}
}

func (wl *wireLog) outcome(seq uint64, want sink.Outcome) {
	wl.t.Helper()
	if d, ok := wl.rec.at(seq); !ok || d.Outcome != want {
		wl.t.Errorf("log position %d: outcome %v (reported %v), want %v", seq, d.Outcome, ok, want)
	}
}

// An aborted attempt applies nothing, its retry applies all its effects at
// once, a job the worker skipped (its attempt never completed) is dropped
// when the next job applies, a replay of an applied job is a duplicate, and
// effects of no job apply on their own at once, open jobs or not.
func TestJobEffectsAllOrNone(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "aon")
	r := start(t, wl.js, wl.cfg)
	a1 := wl.effect(10, 1, 0)
	wl.effect(10, 1, 1)
	wl.pub(1, "aon.0.10.abort.1", leasehold.JobMark{Job: 10, Attempt: 1, Abort: true}, false)
	s1 := wl.pub(1, "s1", leasehold.JobMark{}, false)
	wl.wait(r, s1)
	wl.want(map[string]int{"s1": 1})
	wl.outcome(a1, sink.Aborted)

	wl.effect(10, 2, 0)
	wl.effect(10, 2, 1)
	f10 := wl.final(10, 2, 2, 0)
	wl.wait(r, f10)
	wl.want(map[string]int{"s1": 1, "aon.0.10.0": 1, "aon.0.10.1": 1, "aon.0.10.2": 1})

	open := wl.effect(11, 3, 0)
	s2 := wl.pub(1, "s2", leasehold.JobMark{}, false)
	wl.wait(r, s2)
	wl.want(map[string]int{"s1": 1, "s2": 1, "aon.0.10.0": 1, "aon.0.10.1": 1, "aon.0.10.2": 1})

	f12 := wl.final(12, 4, 0, 10)
	replay := wl.final(10, 2, 2, 0)
	wl.wait(r, replay)
	wl.want(map[string]int{"s1": 1, "s2": 1, "aon.0.10.0": 1, "aon.0.10.1": 1, "aon.0.10.2": 1, "aon.0.12.0": 1})
	wl.outcome(open, sink.Aborted)
	wl.outcome(f12, sink.Accepted)
	wl.outcome(replay, sink.Duplicate)
}

// A job's one effect waits for the job its final names, even with no
// effect of any other job open on the subject: applied first, it would
// have the earlier job taken for a duplicate and never applied.
func TestJobEffectsWaitForTheJobBefore(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "order")
	r := start(t, wl.js, wl.cfg)
	f1 := wl.final(1, 1, 0, 0)
	wl.wait(r, f1)
	f3 := wl.final(3, 3, 0, 2)
	s1 := wl.pub(1, "s1", leasehold.JobMark{}, false)
	wl.wait(r, s1)
	wl.want(map[string]int{"order.0.1.0": 1, "s1": 1})
	f2 := wl.final(2, 2, 0, 1)
	wl.wait(r, f2)
	wl.want(map[string]int{"order.0.1.0": 1, "s1": 1, "order.0.2.0": 1, "order.0.3.0": 1})
	wl.outcome(f2, sink.Accepted)
	wl.outcome(f3, sink.Accepted)
	wl.applied.mu.Lock()
	got := slices.Clone(wl.applied.keys)
	wl.applied.mu.Unlock()
	if want := []string{"order.0.1.0", "s1", "order.0.2.0", "order.0.3.0"}; !slices.Equal(got, want) {
		t.Errorf("applied in the order %v, want %v", got, want)
	}
}

// A runner that stops while a job is open saves a position short of the
// job's first effect; the next one reads the log again from there, applies
// the job once the rest of it comes, and takes the jobs it applied before
// for duplicates.
func TestJobEffectsAcrossRestart(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "crash")
	r := start(t, wl.js, wl.cfg)
	first := wl.effect(20, 2, 0)
	f19 := wl.final(19, 1, 0, 0)
	wl.wait(r, f19)
	wl.want(map[string]int{"crash.0.19.0": 1})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	again, err := streamsink.New(ctxFor(t, time.Minute), wl.js, wl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p := again.Position(); p >= first {
		t.Fatalf("the saved position %d passed the open job's first effect at %d", p, first)
	}
	f20 := wl.final(20, 2, 1, 19)
	r2 := run(t, again)
	wl.wait(r2, f20)
	wl.want(map[string]int{"crash.0.19.0": 1, "crash.0.20.0": 1, "crash.0.20.1": 1})
	wl.outcome(f19, sink.Duplicate)
}

// A crash between delivering a job's effects and saving the position makes
// the next runner apply the job again, whole: never a part of it.
func TestJobEffectsCrashBeforeSave(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "mid")
	r, err := streamsink.New(ctxFor(t, time.Minute), wl.js, wl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	crashed := make(chan struct{})
	r.SetHook(func(point string) error {
		if point == "delivered" && len(wl.applied.snapshot()) == 2 {
			close(crashed)
			return fmt.Errorf("crash")
		}
		return nil
	})
	wl.effect(30, 1, 0)
	wl.final(30, 1, 1, 0)
	rr := run(t, r)
	<-crashed
	if err := rr.stop(); err == nil {
		t.Fatal("Run returned nil after the hook stopped it")
	}
	again := start(t, wl.js, wl.cfg)
	f31 := wl.final(31, 2, 0, 30)
	wl.wait(again, f31)
	wl.want(map[string]int{"mid.0.30.0": 2, "mid.0.30.1": 2, "mid.0.31.0": 1})
}

// A rewind runs jobs again under higher attempt numbers: a job whose final
// was lost completes with its re-run, the next job, complete before the
// rewind, applies after it, and its own re-run is a duplicate.
func TestJobEffectsRewind(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "rewind")
	r := start(t, wl.js, wl.cfg)
	wl.effect(40, 1, 0) // its final was not stored
	early := wl.final(41, 2, 0, 40)
	wl.wait(r, early)
	wl.want(map[string]int{})
	wl.effect(40, 3, 0)
	wl.final(40, 3, 1, 0)
	rerun := wl.final(41, 4, 0, 40)
	wl.wait(r, rerun)
	wl.want(map[string]int{"rewind.0.40.0": 1, "rewind.0.40.1": 1, "rewind.0.41.0": 1})
	wl.applied.mu.Lock()
	order := slices.Clone(wl.applied.keys)
	wl.applied.mu.Unlock()
	if i, j := slices.Index(order, "rewind.0.40.1"), slices.Index(order, "rewind.0.41.0"); i > j {
		t.Errorf("applied in order %v: job 41 before job 40", order)
	}
	wl.outcome(rerun, sink.Duplicate)
}

// A successor's barrier abandons what the earlier holder left open: the
// job is never applied, its late final is stale, and the saved position
// moves on past it.
func TestJobEffectsBarrierAbandons(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "fence")
	r := start(t, wl.js, wl.cfg)
	open := wl.effect(50, 1, 0)
	wl.pub(2, leasehold.BarrierKey("fence", 0, 2), leasehold.JobMark{}, true)
	late := wl.final(50, 1, 1, 0)
	next := wl.pub(2, "fence.0.51.0", leasehold.JobMark{Job: 51, Attempt: 1, Effects: 1}, false)
	wl.wait(r, next)
	wl.want(map[string]int{"fence.0.51.0": 1})
	wl.outcome(open, sink.Aborted)
	wl.outcome(late, sink.Stale)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	again, err := streamsink.New(ctxFor(t, time.Minute), wl.js, wl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p := again.Position(); p != next {
		t.Errorf("saved position %d, want %d: nothing is open", p, next)
	}
}

// Past Config.MaxHeldEffects the runner stops and says so in Ready; raised,
// it goes on and applies what was held.
func TestJobEffectsLimit(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "limit")
	cfg := wl.cfg
	cfg.MaxHeldEffects = 2
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	cfg.Telemetry = telemetry.Config{MeterProvider: mp}
	cfg.Name = "limit"
	r := start(t, wl.js, cfg)
	wl.effect(60, 1, 0)
	wl.effect(60, 1, 1)
	wl.final(60, 1, 2, 0)
	ctx := ctxFor(t, time.Minute)
	err := awaitReady(t, ctx, r.Runner, "Ready to report the limit", func(err error) bool { return err != nil })
	if !errors.Is(err, streamsink.ErrGroupLimit) {
		t.Fatalf("Ready: %v, want ErrGroupLimit", err)
	}
	wl.want(map[string]int{})
	if n := sinkMetric(t, reader, "limit", "leasehold.sink.job_effects_held"); n != 2 {
		t.Errorf("leasehold.sink.job_effects_held is %d, want the 2 effects held", n)
	}
	if err := r.stop(); err != nil && !errors.Is(err, streamsink.ErrGroupLimit) {
		t.Fatal(err)
	}
	cfg.MaxHeldEffects = 3
	again := start(t, wl.js, cfg)
	wl.wait(again, 3)
	wl.want(map[string]int{"limit.0.60.0": 1, "limit.0.60.1": 1, "limit.0.60.2": 1})
}

// What was applied survives a restart whether it was saved in the position
// record's list or, once that list was long, in the applied shards.
func TestJobEffectsAppliedSaved(t *testing.T) {
	defer streamsink.SetMaxDelta(2)()
	wl := newWireLog(t, "saved")
	r := start(t, wl.js, wl.cfg)
	var last uint64
	for p := range leasehold.Partition(5) {
		h := nats.Header{}
		leasehold.Stamp{Scope: "saved", Partition: p, Epoch: 1, Acquisition: "a1", Key: fmt.Sprintf("saved.%d.9.0", p), Worker: "w1"}.SetHeader(h)
		leasehold.JobMark{Job: 9, Attempt: 1, Effects: 1}.SetHeader(h)
		ack, err := wl.js.PublishMsg(ctxFor(t, 30*time.Second), &nats.Msg{Subject: fmt.Sprintf("saved.out.%d", p), Header: h, Data: []byte("x")})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
		// One batch each, so that the list grows past its bound.
		wl.wait(r, last)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	again := start(t, wl.js, wl.cfg)
	// Replays of every job: each is a duplicate, not applied again.
	msgs := readLog(t, wl.js, "saved-effects")
	for _, m := range msgs {
		ack, err := wl.js.PublishMsg(ctxFor(t, 30*time.Second), &nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	wl.wait(again, last)
	got := wl.applied.snapshot()
	if len(got) != 5 {
		t.Errorf("applied %v, want 5 effects", got)
	}
	for k, n := range got {
		if n != 1 {
			t.Errorf("effect %s applied %d times after a restart and replays", k, n)
		}
	}
}

// readLog reads every message of stream.
func readLog(t *testing.T, js jetstream.JetStream, stream string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}
