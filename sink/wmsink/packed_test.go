package wmsink_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
)

// A message packing several effects (a worker with PackEffects) is not
// one effect: the fencer does not hand its body to the handler as one, but
// reports it, names what to do, and moves it to the poison topic whole,
// data and pack header included. The next message is handled.
func TestPackedMessageIsNotHandedOnAsOneEffect(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	defer pubsub.Close()
	decided := make(chan sink.Decision, 100)
	f, err := wmsink.New(wmsink.Config{
		UnsafeArrivalOrder: true,
		Logger:             quiet(),
		Observer:           sink.ObserverFunc(func(_ context.Context, d sink.Decision) { decided <- d }),
		Poison:             pubsub,
		PoisonTopic:        "poison",
	})
	if err != nil {
		t.Fatal(err)
	}
	poisoned, err := pubsub.Subscribe(ctx, "poison")
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(f.Middleware)
	handled := make(chan string, 10)
	router.AddConsumerHandler("h", "effects", pubsub, func(msg *message.Message) error {
		handled <- msg.Metadata.Get(leasehold.HeaderKey)
		return nil
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()

	st := leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 7, Acquisition: "a7", Key: leasehold.OriginOf("orders", 1, 3).EffectKey(1)}
	body := leasehold.AppendPacked(nil, leasehold.PackedEffect{Key: leasehold.OriginOf("orders", 1, 3).EffectKey(0), Data: []byte("first")})
	body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: st.Key, Data: []byte("second")})
	packed := message.NewMessage(watermill.NewUUID(), body)
	h := map[string][]string{}
	st.SetHeaderAs(h, leasehold.StampCompact)
	leasehold.JobMark{Job: 3, Attempt: 1, Effects: 2}.SetHeaderAs(h, leasehold.StampCompact)
	leasehold.SetPackHeader(h, 2)
	for k, vs := range h {
		packed.Metadata.Set(k, vs[0])
	}
	if err := pubsub.Publish("effects", packed); err != nil {
		t.Fatal(err)
	}
	for refused := false; !refused; {
		select {
		case d := <-decided:
			if d.Outcome == sink.Accepted {
				t.Fatalf("the packed message was accepted, and its body handed on as one effect")
			}
			if d.Outcome != sink.BadStamp {
				continue
			}
			if !errors.Is(d.Err, leasehold.ErrBadPack) || !strings.Contains(d.Err.Error(), "stream sink") {
				t.Fatalf("the packed message's decision says %v", d.Err)
			}
			refused = true
		case k := <-handled:
			t.Fatalf("the handler got %q: the packed message was handed on as one effect", k)
		case <-ctx.Done():
			t.Fatal("no decision for the packed message")
		}
	}
	select {
	case m := <-poisoned:
		m.Ack()
		if m.UUID != packed.UUID || string(m.Payload) != string(body) || m.Metadata.Get(leasehold.HeaderPack) != "1 2" {
			t.Fatalf("poisoned %s with %d bytes and pack header %q, want the packed message whole", m.UUID, len(m.Payload), m.Metadata.Get(leasehold.HeaderPack))
		}
	case <-ctx.Done():
		t.Fatal("the packed message did not reach the poison topic")
	}
	next := message.NewMessage(watermill.NewUUID(), []byte("next"))
	leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 7, Acquisition: "a7", Key: "next"}.SetMetadata(next.Metadata)
	if err := pubsub.Publish("effects", next); err != nil {
		t.Fatal(err)
	}
	select {
	case k := <-handled:
		if k != "next" {
			t.Fatalf("the handler got %q: the packed message was handed on", k)
		}
	case <-ctx.Done():
		t.Fatal("the message after the packed one was not handled")
	}
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
