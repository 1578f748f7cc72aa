package worker

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A duplicate acknowledgement is confirmed against the stored message: the
// worker's own message passes, anything else stored under its ID first is
// refused as a pre-emption.
func TestConfirmDuplicateAcknowledgement(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := natstest.Start(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "out", Subjects: []string{"out.>"}, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	r := &runner{w: &Worker{cfg: Config{JetStream: js, EffectTimeout: 5 * time.Second}, tel: telemetry.New(telemetry.Config{})}, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	stamp := leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 9, Acquisition: "a9", Key: "orders.1.5.0"}
	mine := func(data string) *nats.Msg {
		m := nats.NewMsg("out.1")
		m.Data = []byte(data)
		stamp.SetHeader(m.Header)
		m.Header.Set(jetstream.MsgIDHeader, MessageID(stamp, "n1"))
		return m
	}
	publish := func(m *nats.Msg) *jetstream.PubAck {
		ack, err := js.PublishMsg(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		return ack
	}

	// Someone else got there first with the same ID.
	forged := nats.NewMsg("out.1")
	forged.Data = []byte("garbage")
	forged.Header.Set(jetstream.MsgIDHeader, MessageID(stamp, "n1"))
	publish(forged)
	m := mine("paid")
	ack := publish(m)
	if !ack.Duplicate {
		t.Fatal("the second publish under one ID was not answered as a duplicate")
	}
	if err := r.confirm(ctx, m, ack); !errors.Is(err, ErrPreempted) {
		t.Fatalf("confirm(a duplicate of someone else's message) = %v, want ErrPreempted", err)
	}

	// The worker's own message, published twice (a retry): confirmed.
	stamp.Key = "orders.1.6.0"
	own := mine("shipped")
	publish(own)
	again := mine("shipped")
	ack = publish(again)
	if !ack.Duplicate {
		t.Fatal("the retry was not answered as a duplicate")
	}
	if err := r.confirm(ctx, again, ack); err != nil {
		t.Fatalf("confirm(a retry of the worker's own message) = %v, want nil", err)
	}
	if err := r.confirm(ctx, own, &jetstream.PubAck{Stream: "out", Sequence: 99}); err != nil {
		t.Fatalf("confirm(a plain acknowledgement) = %v, want nil", err)
	}
}
