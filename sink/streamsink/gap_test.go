package streamsink_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
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

// gapGauge reads leasehold.sink.gap for sink name: 0 when not reported.
func gapGauge(t *testing.T, reader *sdkmetric.ManualReader, name string) int64 {
	return max(sinkMetric(t, reader, name, "leasehold.sink.gap"), 0)
}

// applied records the keys a Handler was given, in order.
type applied struct {
	mu   sync.Mutex
	keys []string
}

func (a *applied) handle(_ context.Context, e sink.Effect) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.keys = append(a.keys, e.Stamp.Key)
	return nil
}

func (a *applied) list() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.keys)
}

// publishStamped publishes one stamped message of partition 0 and returns
// its log position.
func publishStamped(t *testing.T, ctx context.Context, js jetstream.JetStream, subject, scope string, e leasehold.Epoch, key string, barrier bool) uint64 {
	t.Helper()
	h := nats.Header{}
	leasehold.Stamp{Scope: scope, Epoch: e, Acquisition: fmt.Sprintf("a%d", e), Key: key, Worker: fmt.Sprintf("w%d", e)}.SetHeader(h)
	if barrier {
		h.Set(leasehold.HeaderBarrier, "1")
	}
	ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: subject, Header: h, Data: []byte(key)})
	if err != nil {
		t.Fatalf("publish %s: %v", key, err)
	}
	return ack.Sequence
}

// awaitReady waits until Ready's answer satisfies cond, failing with what
// was awaited when ctx ends first.
func awaitReady(t *testing.T, ctx context.Context, r *streamsink.Runner, what string, cond func(error) bool) error {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		err := r.Ready(ctx)
		if cond(err) {
			return err
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for Ready to report %s: last answer %v", what, err)
		case <-tick.C:
		}
	}
}

// A runner that was down while its log's limits trimmed messages it had
// not handled, a take-over's barrier among them, stops at the gap: it
// applies nothing past it (a silent skip would apply the zombie effect the
// lost barrier fences), Ready fails with ErrGap, and only an operator's
// resume moves it on, recorded in its saved state.
func TestGapAfterTrimStopsTheRunner(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	const prefix = "gap"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: prefix + "-effects", Subjects: []string{prefix + ".out.>"}, MaxMsgs: 3, Discard: jetstream.DiscardOld,
	}); err != nil {
		t.Fatal(err)
	}
	got := &applied{}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	cfg := streamsink.Config{Prefix: prefix, AllowTrimming: true, Handler: got.handle, Logger: quiet(), Telemetry: telemetry.Config{MeterProvider: mp}}
	subject := prefix + ".out.p0"
	rr := start(t, js, cfg)
	var last uint64
	for i := range 3 {
		last = publishStamped(t, ctx, js, subject, prefix, 5, fmt.Sprintf("old.%d", i), false)
	}
	if err := rr.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	if err := rr.Ready(ctx); err != nil {
		t.Fatalf("Ready of a runner with no gap: %v", err)
	}
	if err := rr.stop(); err != nil {
		t.Fatal(err)
	}
	before := got.list()

	// While the runner is down: the new holder's barrier and first effect
	// (trimmed), then a zombie effect of the old holder and the new
	// holder's next effects (kept).
	from := publishStamped(t, ctx, js, subject, prefix, 7, leasehold.BarrierKey(prefix, 0, 7), true)
	to := publishStamped(t, ctx, js, subject, prefix, 7, "new.0", false)
	zombie := publishStamped(t, ctx, js, subject, prefix, 5, "zombie", false)
	publishStamped(t, ctx, js, subject, prefix, 7, "new.1", false)
	last = publishStamped(t, ctx, js, subject, prefix, 7, "new.2", false)

	rr = start(t, js, cfg)
	err := awaitReady(t, ctx, rr.Runner, "a gap", func(err error) bool { return errors.Is(err, streamsink.ErrGap) })
	var gap *streamsink.GapError
	if !errors.Is(err, streamsink.ErrGap) || !errors.As(err, &gap) || gap.From != from || gap.To != to {
		t.Fatalf("Ready: %v, want a GapError from %d to %d", err, from, to)
	}
	if v := gapGauge(t, reader, "stream"); v != 1 {
		t.Fatalf("leasehold.sink.gap at the gap: %d, want 1", v)
	}
	// The runner may fetch the messages past the gap any number of times:
	// it must decide none of them. A resume past a position that still
	// holds a message of the runner's, or past the end of the log, is
	// refused.
	if err := rr.ResumeAfterGap(ctx, zombie); err == nil {
		t.Fatalf("ResumeAfterGap(%d) past a message still in the log was accepted", zombie)
	}
	if err := rr.ResumeAfterGap(ctx, last+10); err == nil {
		t.Fatalf("ResumeAfterGap(%d) past the end of the log was accepted", last+10)
	}
	if p := rr.Position(); p != from-1 {
		t.Fatalf("position %d at the gap, want %d", p, from-1)
	}
	if now := got.list(); !slices.Equal(now, before) {
		t.Fatalf("applied past the gap: %v, had %v", now, before)
	}

	if err := rr.ResumeAfterGap(ctx, to); err != nil {
		t.Fatal(err)
	}
	if err := rr.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	if err := rr.Ready(ctx); err != nil {
		t.Fatalf("Ready after the resume: %v", err)
	}
	if v := gapGauge(t, reader, "stream"); v != 0 {
		t.Fatalf("leasehold.sink.gap after the resume: %d, want 0", v)
	}
	now := got.list()
	if !slices.Contains(now, "new.1") || !slices.Contains(now, "new.2") || slices.Contains(now, "new.0") {
		t.Fatalf("applied after the resume: %v", now)
	}
	// The saved state records the skip.
	state := savedState(t, js, prefix)
	var saved struct {
		Skipped []struct{ From, To uint64 } `json:"skipped"`
	}
	if err := json.Unmarshal(state, &saved); err != nil || len(saved.Skipped) != 1 || saved.Skipped[0].From != from || saved.Skipped[0].To != to {
		t.Fatalf("saved state %s (%v): want the skip of %d to %d recorded", state, err, from, to)
	}
	// The resume is idempotent: a runner started again with the same
	// resume (a flag left in place) finds nothing to skip.
	if err := rr.stop(); err != nil {
		t.Fatal(err)
	}
	r2, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r2.ResumeAfterGap(ctx, to); err != nil {
		t.Fatalf("a repeated resume: %v", err)
	}
	rr = run(t, r2)
	awaitReady(t, ctx, rr.Runner, "ready", func(err error) bool { return err == nil })
}

// A runner whose filter covers part of its log is not stopped by the
// other subjects' messages between its own; a message of its own removed
// by hand is a gap.
func TestGapFilteredLog(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	const prefix = "gapf"
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: prefix + "-effects", Subjects: []string{prefix + ".out.>", prefix + ".other.>"}})
	if err != nil {
		t.Fatal(err)
	}
	got := &applied{}
	cfg := streamsink.Config{Prefix: prefix, FilterSubject: prefix + ".out.>", Handler: got.handle, Logger: quiet()}
	rr := start(t, js, cfg)
	ours, others := prefix+".out.p0", prefix+".other.x"
	var last uint64
	for i := range 5 {
		publishStamped(t, ctx, js, others, prefix, 5, fmt.Sprintf("other.%d", i), false)
		last = publishStamped(t, ctx, js, ours, prefix, 5, fmt.Sprintf("ours.%d", i), false)
	}
	if err := rr.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	if err := rr.Ready(ctx); err != nil {
		t.Fatalf("Ready: %v", err)
	}
	if err := rr.stop(); err != nil {
		t.Fatal(err)
	}
	publishStamped(t, ctx, js, others, prefix, 5, "other.5", false)
	lost := publishStamped(t, ctx, js, ours, prefix, 5, "ours.5", false)
	publishStamped(t, ctx, js, others, prefix, 5, "other.6", false)
	publishStamped(t, ctx, js, ours, prefix, 5, "ours.6", false)
	if err := s.DeleteMsg(ctx, lost); err != nil {
		t.Fatal(err)
	}
	rr = start(t, js, cfg)
	err = awaitReady(t, ctx, rr.Runner, "a gap", func(err error) bool { return errors.Is(err, streamsink.ErrGap) })
	var gap *streamsink.GapError
	if !errors.As(err, &gap) || gap.From != last+1 || gap.To != lost+1 {
		t.Fatalf("Ready: %v, want a GapError from %d to %d", err, last+1, lost+1)
	}
	if n := len(got.list()); n != 5 {
		t.Fatalf("%d effects applied, want the 5 before the gap", n)
	}
}
