package main

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// What init creates is what the sink wants: a sink started right after it
// has nothing to warn about. Its effect log forbids deleting and purging
// messages by hand (a message removed before the sink handled it may have
// been a take-over's barrier); an existing log that allows it is left as
// it is, and init says how to change it.
func TestInitEffectLogSuitsTheSink(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, time.Minute)
	js := s.JetStream(t)
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", "2")
	st, err := js.Stream(ctx, worker.EffectsStream("leasehold"))
	if err != nil {
		t.Fatal(err)
	}
	if sc := st.CachedInfo().Config; !sc.DenyDelete || !sc.DenyPurge {
		t.Errorf("init's effect log: DenyDelete %v, DenyPurge %v; want both", sc.DenyDelete, sc.DenyPurge)
	}
	var logs bytes.Buffer
	r, err := streamsink.New(ctx, js, streamsink.Config{
		Name: "fresh", Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		BatchHandler: func(context.Context, []sink.Effect) error { return nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	if r.Retention().Deletable || r.Retention().Trims() {
		t.Errorf("the sink finds init's effect log can lose messages: %s", r.Retention())
	}
	if strings.Contains(logs.String(), "can lose messages") {
		t.Errorf("the sink warns right after init:\n%s", logs.String())
	}
	// Running init again changes nothing and notes nothing about it.
	if out := mustRun(t, ctx, "init", "--nats", s.URL()); strings.Contains(out, "deny-delete") {
		t.Errorf("a second init notes the effect log:\n%s", out)
	}

	// A log made before, without the settings: init notes it and leaves it.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "old-effects", Subjects: []string{"old.out.>"}}); err != nil {
		t.Fatal(err)
	}
	note, err := guardEffectLog(ctx, js, "old-effects", false)
	if err != nil || !strings.Contains(note, "nats stream edit old-effects --deny-delete --deny-purge") {
		t.Errorf("an existing log that allows removals: note %q, %v", note, err)
	}
	if old, _ := js.Stream(ctx, "old-effects"); old.CachedInfo().Config.DenyDelete {
		t.Error("init changed an existing effect log's settings")
	}
}

// A sink started before init says first what to do.
func TestSinkBeforeInit(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, time.Minute)
	_, err := run(t, ctx, "sink", "--nats", s.URL(), "--http", "", "--log-level", "error")
	if err == nil || !strings.HasPrefix(err.Error(), "run `leasehold init --prefix leasehold` first") {
		t.Fatalf("sink before init: %v; want it to lead with `leasehold init`", err)
	}
	if strings.Contains(err.Error(), "--verify-epochs") {
		t.Errorf("sink before init names a flag the user never set: %v", err)
	}
}
