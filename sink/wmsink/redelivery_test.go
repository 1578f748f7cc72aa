package wmsink_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// nakDelay is watermill-nats' delay before a nacked message comes again.
type nakDelay time.Duration

func (d nakDelay) WaitTime(uint64) time.Duration { return time.Duration(d) }

// routed configures logCase.router.
type routed struct {
	obs  sink.Observer
	init wmjs.ResourceInitializer // nil: an ephemeral consumer
	nak  time.Duration            // the delay before a nacked message comes again; default 10 ms
}

// logCase is an effect log in a JetStream stream "effects": a former
// holder's effect "old" (epoch 5), the new holder's barrier (epoch 7), its
// effect "new", and the former holder's "late", published after the
// barrier.
type logCase struct {
	srv *natstest.Server
	js  jetstream.JetStream
}

func newLogCase(t *testing.T, ctx context.Context, cfg jetstream.StreamConfig) *logCase {
	t.Helper()
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	cfg.Name, cfg.Subjects = "effects", []string{"effects"}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	c := &logCase{srv: srv, js: js}
	c.publish(t, ctx, 5, "old", false)
	c.publish(t, ctx, 7, "barrier", true)
	c.publish(t, ctx, 7, "new", false)
	c.publish(t, ctx, 5, "late", false)
	return c
}

// publish stores a stamped message as a worker does.
func (c *logCase) publish(t *testing.T, ctx context.Context, e leasehold.Epoch, key string, barrier bool) {
	t.Helper()
	m := nats.NewMsg("effects")
	leasehold.Stamp{Scope: "orders", Partition: 0, Epoch: e, Acquisition: "a" + e.String(), Key: key, Worker: "w" + e.String()}.SetHeader(m.Header)
	if barrier {
		m.Header.Set(leasehold.HeaderBarrier, "1")
	}
	if _, err := c.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
}

// durable is a watermill-nats resource initializer for the durable
// consumer "fenced" of the effects stream, so that a second subscriber
// takes over what the first left unacknowledged.
func durable(ctx context.Context, js jetstream.JetStream, topic string) (jetstream.Consumer, func(context.Context, watermill.LoggerAdapter), error) {
	c, err := js.CreateOrUpdateConsumer(ctx, topic, jetstream.ConsumerConfig{Durable: "fenced", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 2 * time.Second})
	return c, nil, err
}

// decisions collects a Fencer's decisions.
type decisions struct {
	mu  sync.Mutex
	all []sink.Decision
	c   chan sink.Decision
}

func newDecisions() *decisions { return &decisions{c: make(chan sink.Decision, 100)} }

func (d *decisions) Decided(_ context.Context, x sink.Decision) {
	d.mu.Lock()
	d.all = append(d.all, x)
	d.mu.Unlock()
	d.c <- x
}

// router runs a Router whose handler h is fenced by a new Fencer over a
// watermill-nats JetStream subscriber of the effects stream, and returns
// a function that stops it.
//
// watermill-nats' JetStream subscriber closes its channel while its
// message handler may be sending to it, a data race (pkg/jetstream
// consumer.go monitor, message_handler.go handleMsg): the tests stop a
// router only while no message is on its way to the channel.
func (c *logCase) router(t *testing.T, ctx context.Context, o routed, h message.NoPublishHandlerFunc) (*wmsink.Fencer, func()) {
	t.Helper()
	f, err := wmsink.New(wmsink.Config{JetStream: c.js, Observer: o.obs, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if o.nak == 0 {
		o.nak = 10 * time.Millisecond
	}
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{
		Conn: c.srv.Connect(t), Logger: watermill.NopLogger{}, NakDelay: nakDelay(o.nak),
		ResourceInitializer: o.init, Unmarshaler: f.Unmarshaler(nil),
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(f.Middleware)
	r.AddConsumerHandler("h", "effects", sub, h)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.WithoutCancel(ctx)) }()
	select {
	case <-r.Running():
	case <-ctx.Done():
		t.Fatal("the router did not start")
	}
	return f, func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

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
