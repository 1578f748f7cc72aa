package streamsink_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// An effect that would create a fence beyond Config.MaxFences is refused
// with ErrFenceLimit and the runner goes on; fences it keeps carry on.
func TestFenceLimit(t *testing.T) {
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	rec := &positions{}
	cfg := streamsink.Config{Prefix: "limit", MaxFences: 3, Logger: quiet(), Observer: rec}
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
