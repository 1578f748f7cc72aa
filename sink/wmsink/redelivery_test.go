package wmsink_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
)

// A former holder's message that preceded the barrier in the log is
// nacked (a database blip), the barrier goes through, and the message is
// redelivered: it is admitted, as it was committed. The former holder's
// message after the barrier is refused.
func TestRedeliveryBeforeBarrierIsAdmitted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := newLogCase(t, ctx, jetstream.StreamConfig{})
	var barrierDone atomic.Bool
	obs := newDecisions()
	handled := make(chan string, 10)
	f, stop := c.router(t, ctx, routed{obs: sink.ObserverFunc(func(ctx context.Context, d sink.Decision) {
		if d.Outcome == sink.Advanced {
			barrierDone.Store(true)
		}
		obs.Decided(ctx, d)
	})}, func(msg *message.Message) error {
		k := msg.Metadata.Get(leasehold.HeaderKey)
		if k == "old" && !barrierDone.Load() {
			return errors.New("the database blinked")
		}
		handled <- k
		return nil
	})
	got := map[string]bool{}
	var refused []string
	for !got["old"] || !got["new"] || len(refused) == 0 {
		select {
		case k := <-handled:
			got[k] = true
		case d := <-obs.c:
			if d.Outcome == sink.Stale {
				refused = append(refused, d.Stamp.Key)
				if d.Stamp.Key == "old" {
					t.Fatalf("the redelivery of old, which preceded the barrier in the log, was refused: %v", d.Err)
				}
			}
		case <-ctx.Done():
			t.Fatalf("handled %v, refused %v; waiting for old and new handled and late refused", got, refused)
		}
	}
	stop()
	if got["late"] || len(refused) != 1 || refused[0] != "late" {
		t.Fatalf("handled %v, refused %v: want late refused and nothing else", got, refused)
	}
	if n := f.Dropped(leasehold.FenceID{Scope: "orders", Partition: 0}); n != 1 {
		t.Fatalf("Dropped = %d, want 1", n)
	}
}

// A process that acked the barrier and stopped with every effect
// unacknowledged is followed by another, with a Fencer of its own, on the
// same durable consumer: the barrier never reaches it, so it reads the log
// where it has not seen it, and judges the redeliveries as their positions
// say.
func TestRestartJudgesRedeliveriesByPosition(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := newLogCase(t, ctx, jetstream.StreamConfig{})
	// The first process takes the four messages and acks the barrier
	// only; the rest come again after the consumer's AckWait.
	cons, _, err := durable(ctx, c.js, "effects")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(4, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for m := range batch.Messages() {
		n++
		if m.Headers().Get(leasehold.HeaderBarrier) != "" {
			if err := m.DoubleAck(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n != 4 {
		t.Fatalf("the first process fetched %d messages, want 4 (%v)", n, batch.Error())
	}
	// The second process.
	second := newDecisions()
	handled := make(chan string, 10)
	_, stop := c.router(t, ctx, routed{obs: second, init: durable}, func(msg *message.Message) error {
		handled <- msg.Metadata.Get(leasehold.HeaderKey)
		return nil
	})
	defer stop()
	late := false
	got := map[string]bool{}
	for !got["old"] || !got["new"] || !late {
		select {
		case k := <-handled:
			got[k] = true
		case d := <-second.c:
			if d.Outcome == sink.Stale {
				if d.Stamp.Key != "late" {
					t.Fatalf("the second process refused %s: %v", d.Stamp.Key, d.Err)
				}
				late = true
			}
		case <-ctx.Done():
			t.Fatalf("the second process handled %v (late refused: %v); waiting for old and new handled and late refused", got, late)
		}
	}
	if got["late"] {
		t.Fatal("the second process handled late, published after the barrier")
	}
}

// A log that can lose messages is not judged: its messages are nacked
// with ErrLogNotKept, and never reach the handler.
func TestLogThatLosesMessagesIsRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := newLogCase(t, ctx, jetstream.StreamConfig{MaxAge: time.Hour})
	obs := newDecisions()
	var handled atomic.Int64
	// A nacked message comes again only after the test: each of the four
	// is refused once.
	_, stop := c.router(t, ctx, routed{obs: obs, nak: time.Hour}, func(msg *message.Message) error {
		handled.Add(1)
		return nil
	})
	defer stop()
	for n := 0; n < 4; n++ {
		select {
		case d := <-obs.c:
			if d.Outcome != sink.Failed || !errors.Is(d.Err, wmsink.ErrLogNotKept) {
				t.Fatalf("decision %s (%v), want a failure matching ErrLogNotKept", d.Outcome, d.Err)
			}
		case <-ctx.Done():
			t.Fatalf("waiting for the refusal of the log's messages (%d of 4)", n)
		}
	}
	if n := handled.Load(); n != 0 {
		t.Fatalf("%d messages handled", n)
	}
}

// A consumer that starts after the barrier never gets it delivered: the
// Fencer reads the log before its first message, and refuses the former
// holder's message that followed the barrier.
func TestConsumerStartingAfterTheBarrier(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := newLogCase(t, ctx, jetstream.StreamConfig{})
	obs := newDecisions()
	handled := make(chan string, 10)
	fromNew := func(ctx context.Context, js jetstream.JetStream, topic string) (jetstream.Consumer, func(context.Context, watermill.LoggerAdapter), error) {
		cons, err := js.CreateOrUpdateConsumer(ctx, topic, jetstream.ConsumerConfig{
			Durable: "from-new", AckPolicy: jetstream.AckExplicitPolicy,
			DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: 3,
		})
		return cons, nil, err
	}
	_, stop := c.router(t, ctx, routed{obs: obs, init: fromNew}, func(msg *message.Message) error {
		handled <- msg.Metadata.Get(leasehold.HeaderKey)
		return nil
	})
	defer stop()
	for gotNew, late := false, false; !gotNew || !late; {
		select {
		case k := <-handled:
			if k != "new" {
				t.Fatalf("handled %s: the former holder's message after the barrier was admitted", k)
			}
			gotNew = true
		case d := <-obs.c:
			late = late || (d.Outcome == sink.Stale && d.Stamp.Key == "late")
		case <-ctx.Done():
			t.Fatal("waiting for new handled and late refused")
		}
	}
}
