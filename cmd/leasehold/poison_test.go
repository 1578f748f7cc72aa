package main

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// An effect whose stamp is valid but whose key the KV sink cannot use as
// a key ("a*b" passes the stamp's rules, not KV's) must not stop the sink:
// it is refused, said so in the log, and every effect after it is applied.
// It used to be retried for ever, and nothing behind it was applied again.
func TestSinkSkipsAnEffectItCanNeverApply(t *testing.T) {
	s := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if out, err := run(t, ctx, "init", "--nats", s.URL(), "--partitions", "1", "--prefix", "poison"); err != nil {
		t.Fatalf("init: %v\n%s", err, out)
	}
	background(t, "sink", "--nats", s.URL(), "--prefix", "poison", "--kind", "kv", "--kv-bucket", "poison-sink", "--http", "", "--log-level", "error")
	js := s.JetStream(t)
	publish := func(key string, barrier bool) {
		msg := nats.NewMsg(worker.OutputSubject("poison", 0))
		leasehold.Stamp{Scope: "poison", Partition: 0, Epoch: 5, Acquisition: "a5", Key: key, Worker: "w"}.SetHeader(msg.Header)
		if barrier {
			msg.Header.Set(leasehold.HeaderBarrier, "1")
		}
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	publish(leasehold.BarrierKey("poison", 0, 5), true)
	publish("poison.bad*key", false)
	publish("poison.0.2.0", false)
	var kv jetstream.KeyValue
	for {
		var err error
		if kv == nil {
			kv, _ = js.KeyValue(ctx, "poison-sink")
		}
		if kv != nil {
			if _, err = kv.Get(ctx, "poison.0.2.0"); err == nil {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the effect after the unusable key was never applied: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
