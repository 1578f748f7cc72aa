package main

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// An effect whose stamp is valid but whose key the KV sink cannot use as
// a key ("a*b" passes the stamp's rules, not KV's) must not stop the sink:
// it is moved to the sink's dead-letter stream, and every effect after it
// is applied. It used to be retried for ever, and nothing behind it was
// applied again.
func TestSinkSkipsAnEffectItCanNeverApply(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, 60*time.Second, "--partitions", "1", "--prefix", "poison")
	// The stamps below are made by hand, not issued by the lease bucket:
	// the test is about the key, so the epochs go unverified.
	background(t, "sink", "--nats", s.URL(), "--prefix", "poison", "--kind", "kv", "--kv-bucket", "poison-sink", "--verify-epochs=false", "--http", "", "--log-level", "error")
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
	for ctx.Err() == nil {
		var err error
		if kv == nil {
			kv, _ = js.KeyValue(ctx, "poison-sink")
		}
		if kv != nil {
			if _, err = kv.Get(ctx, "poison.0.2.0"); err == nil {
				break
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the effect after the unusable key was never applied: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	dlq, err := js.Stream(ctx, "poison-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	m, err := dlq.GetLastMsgForSubject(ctx, "poison.sinkdlq.>")
	if err != nil {
		t.Fatalf("the unusable effect is not in the dead-letter stream: %v", err)
	}
	if st, err := leasehold.StampFromHeader(m.Header); err != nil || st.Key != "poison.bad*key" {
		t.Fatalf("dead letter %+v (%v), want the unusable effect", st, err)
	}
}
