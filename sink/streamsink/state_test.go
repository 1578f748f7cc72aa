package streamsink_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// oldState and oldFence are the progress a runner built before fence
// scopes saved, in one KV value under the consumer's name.
type oldState struct {
	Seq    uint64                           `json:"seq"`
	Fences map[leasehold.Partition]oldFence `json:"fences"`
}

type oldFence struct {
	Epoch  leasehold.Epoch `json:"epoch"`
	Holder string          `json:"holder,omitempty"`
}

// Progress saved before fence scopes is refused without Config.LegacyScope,
// with an error that says what to set, and converted in place with it: the
// position and the fences carry on as the scope's, a runner built before
// fence scopes can no longer read the state (it would start over without
// fences), and the setting is not needed again.
func TestLegacyStateConverted(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	const prefix = "legacy"
	rec := &positions{}
	cfg := streamsink.Config{Prefix: prefix, Provision: true, Logger: quiet(), Observer: rec}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	var last uint64
	pub := func(p leasehold.Partition, e leasehold.Epoch, acq, key string) uint64 {
		h := nats.Header{}
		leasehold.Stamp{Scope: prefix, Partition: p, Epoch: e, Acquisition: acq, Key: key, Worker: fmt.Sprintf("w%d", e)}.SetHeader(h)
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: prefix + ".out.x", Header: h, Data: []byte(key)})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
		return ack.Sequence
	}
	// What the old runner handled: epoch 5's effects, then (as its saved
	// fences say) take-overs at epoch 7.
	for p := range leasehold.Partition(3) {
		pub(p, 5, "a5", fmt.Sprintf("old.%d", p))
	}
	handled := last
	old := oldState{Seq: handled, Fences: map[leasehold.Partition]oldFence{0: {7, "w7"}, 1: {7, "w7"}, 2: {7, "w7"}}}
	body, err := json.Marshal(old)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, prefix+"-sink-state")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, prefix+"-sink", body); err != nil {
		t.Fatal(err)
	}

	_, err = streamsink.New(ctx, js, cfg)
	if !errors.Is(err, streamsink.ErrLegacyState) || !strings.Contains(err.Error(), "LegacyScope") {
		t.Fatalf("New over progress saved before fence scopes = %v, want ErrLegacyState naming Config.LegacyScope", err)
	}

	lcfg := cfg
	lcfg.LegacyScope = prefix
	r, err := streamsink.New(ctx, js, lcfg)
	if err != nil {
		t.Fatal(err)
	}
	if r.Position() != handled {
		t.Fatalf("converted position %d, want %d", r.Position(), handled)
	}
	for p := range leasehold.Partition(3) {
		if f := r.Fence(leasehold.FenceID{Scope: prefix, Partition: p}); f != (leasehold.FenceState{Epoch: 7, Holder: "w7"}) {
			t.Fatalf("converted fence of partition %d: %+v, want epoch 7 held by w7 with no acquisition", p, f)
		}
	}
	e, err := kv.Get(ctx, prefix+"-sink")
	if err != nil {
		t.Fatal(err)
	}
	var asOld oldState
	if err := json.Unmarshal(e.Value(), &asOld); err == nil {
		t.Fatalf("a runner built before fence scopes reads the converted state %s without error: it would start over without fences", e.Value())
	}

	// The converted fences judge what follows: the old epoch is stale,
	// the first acquisition of epoch 7 is recorded, and another one of
	// the same epoch is refused as split brain.
	stale := pub(0, 5, "a5", "after.stale")
	fresh := pub(0, 7, "a7", "after.fresh")
	split := pub(0, 7, "b7", "after.split")
	rr := run(t, r)
	if err := rr.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		seq  uint64
		want sink.Outcome
	}{{stale, sink.Stale}, {fresh, sink.Accepted}, {split, sink.SplitBrain}} {
		if d, _ := rec.at(c.seq); d.Outcome != c.want {
			t.Errorf("position %d: %v (%v), want %v", c.seq, d.Outcome, d.Err, c.want)
		}
	}
	for seq := uint64(1); seq <= handled; seq++ {
		if d, ok := rec.at(seq); ok {
			t.Errorf("position %d, handled before the conversion, was decided again: %v", seq, d.Outcome)
		}
	}
	if f := rr.Fence(leasehold.FenceID{Scope: prefix, Partition: 0}); f.Epoch != 7 || f.Acquisition != "a7" {
		t.Fatalf("fence after the first acquisition of epoch 7: %+v", f)
	}
	if err := rr.stop(); err != nil {
		t.Fatal(err)
	}
	again, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatalf("New without LegacyScope after the conversion: %v", err)
	}
	if again.Position() != last || again.Fence(leasehold.FenceID{Scope: prefix, Partition: 1}).Epoch != 7 {
		t.Fatalf("after the conversion: position %d, want %d; fence %+v", again.Position(), last, again.Fence(leasehold.FenceID{Scope: prefix, Partition: 1}))
	}
	got, err := downstream(ctx, js, prefix+"-fenced")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Stamp.Key != "after.fresh" {
		t.Fatalf("downstream %v, want after.fresh alone", got)
	}
}

// Progress saved before fence scopes that holds no fence needs no scope.
func TestLegacyStateWithoutFences(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	cfg := streamsink.Config{Prefix: "empty", Provision: true, Logger: quiet()}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, "empty-sink-state")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "empty-sink", []byte(`{"seq":0,"fences":{}}`)); err != nil {
		t.Fatal(err)
	}
	r, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if r.Position() != 0 || r.Fences() != 0 {
		t.Fatalf("position %d, %d fences", r.Position(), r.Fences())
	}
	if e, err := kv.Get(ctx, "empty-sink"); err != nil || !strings.Contains(string(e.Value()), `"format":2`) {
		t.Fatalf("after New: %v, %v; want the position record converted", e, err)
	}
}

// An effect that would create a fence beyond Config.MaxFences is refused
// with ErrFenceLimit and the runner goes on; fences it keeps carry on.
func TestFenceLimit(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	rec := &positions{}
	cfg := streamsink.Config{Prefix: "limit", Provision: true, MaxFences: 3, Logger: quiet(), Observer: rec}
	r := start(t, js, cfg)
	var last uint64
	pub := func(p leasehold.Partition, key string) uint64 {
		h := nats.Header{}
		leasehold.Stamp{Scope: "limit", Partition: p, Epoch: 5, Acquisition: "a5", Key: key}.SetHeader(h)
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "limit.out.x", Header: h, Data: []byte(key)})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
		return ack.Sequence
	}
	seqs := map[leasehold.Partition]uint64{}
	for p := range leasehold.Partition(6) {
		seqs[p] = pub(p, fmt.Sprintf("first.%d", p))
	}
	again0, again5 := pub(0, "again.0"), pub(5, "again.5")
	if err := r.WaitPosition(ctx, last); err != nil {
		t.Fatalf("the runner stalled at the fence limit: %v", err)
	}
	for p, seq := range seqs {
		d, _ := rec.at(seq)
		if p < 3 && d.Outcome != sink.Accepted {
			t.Errorf("partition %d, within the limit: %v (%v)", p, d.Outcome, d.Err)
		}
		var le *streamsink.FenceLimitError
		if p >= 3 && (!d.Outcome.Dropped() || !errors.Is(d.Err, streamsink.ErrFenceLimit) || !errors.As(d.Err, &le) || le.Max != 3 || le.Shard) {
			t.Errorf("partition %d, beyond the limit: %v (%v), want a drop with a FenceLimitError of max 3", p, d.Outcome, d.Err)
		}
	}
	if d, _ := rec.at(again0); d.Outcome != sink.Accepted {
		t.Errorf("a kept fence's next effect: %v (%v)", d.Outcome, d.Err)
	}
	if d, _ := rec.at(again5); !errors.Is(d.Err, streamsink.ErrFenceLimit) {
		t.Errorf("a refused fence's next effect: %v (%v), want ErrFenceLimit again", d.Outcome, d.Err)
	}
	if n := r.Dropped(leasehold.FenceID{Scope: "limit", Partition: 5}); n != 2 {
		t.Errorf("Dropped(limit/5) = %d, want 2", n)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	again, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n := again.Fences(); n != 3 {
		t.Fatalf("after a restart the runner keeps %d fences, want 3", n)
	}
}
