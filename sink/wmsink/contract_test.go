package wmsink_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

// New refuses a Fencer that could not judge by log position unless it is
// told to judge in arrival order, knowing the risk; ArrivalOrder, which
// did not say so, is refused whatever else is set.
func TestNewRefusesWithoutPositions(t *testing.T) {
	if _, err := wmsink.New(wmsink.Config{}); err == nil {
		t.Fatal("New without JetStream or UnsafeArrivalOrder: no error")
	}
	js := natstest.Start(t).JetStream(t)
	for _, cfg := range []wmsink.Config{{ArrivalOrder: true}, {ArrivalOrder: true, JetStream: js}, {ArrivalOrder: true, UnsafeArrivalOrder: true}} {
		if _, err := wmsink.New(cfg); !errors.Is(err, wmsink.ErrArrivalOrder) {
			t.Errorf("New(ArrivalOrder, JetStream set %v, UnsafeArrivalOrder %v) = %v, want ErrArrivalOrder", cfg.JetStream != nil, cfg.UnsafeArrivalOrder, err)
		}
	}
}

// The decorated subscriber offers SubscribeInitialize when the one it
// decorates does: watermill-nats creates a topic's stream there, and
// without it every subscription fails.
func TestSubscriberKeepsSubscribeInitialize(t *testing.T) {
	srv := natstest.Start(t)
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{Conn: srv.Connect(t), Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := wmsink.New(wmsink.Config{JetStream: srv.JetStream(t), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	dec, err := f.Subscriber()(sub)
	if err != nil {
		t.Fatal(err)
	}
	defer dec.Close()
	init, ok := dec.(message.SubscribeInitializer)
	if !ok {
		t.Fatal("the fencing subscriber hides SubscribeInitialize")
	}
	if err := init.SubscribeInitialize("effects"); err != nil {
		t.Fatal(err)
	}
	if _, err := dec.Subscribe(context.Background(), "effects"); err != nil {
		t.Fatalf("subscribe after SubscribeInitialize: %v", err)
	}
	g := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	plain, _ := f.Subscriber()(g)
	defer plain.Close()
	if _, ok := plain.(message.SubscribeInitializer); ok {
		t.Fatal("the fencing subscriber offers SubscribeInitialize over a subscriber without it")
	}
}

// When Close returns, every channel the subscriber handed out is closed,
// and a message decided but not yet handed out is given back, not
// delivered.
func TestSubscriberCloseClosesOutputs(t *testing.T) {
	g := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	if err := g.Publish("t", stamped("m", stampOf("k"))); err != nil {
		t.Fatal(err)
	}
	// The message's process span starts when the Fencer decides it.
	decided := make(chan struct{}, 1)
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(onStart(func() { decided <- struct{}{} })))
	defer tp.Shutdown(context.Background())
	f, err := wmsink.New(wmsink.Config{UnsafeArrivalOrder: true, Logger: quiet(), Telemetry: telemetry.Config{TracerProvider: tp}})
	if err != nil {
		t.Fatal(err)
	}
	dec, err := f.Subscriber()(g)
	if err != nil {
		t.Fatal(err)
	}
	out, err := dec.Subscribe(context.Background(), "t")
	if err != nil {
		t.Fatal(err)
	}
	// Close once the message is decided and waits for a reader.
	waitDecided(t, decided)
	if err := dec.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case m, open := <-out:
		if open {
			t.Fatalf("message %s delivered after Close", m.UUID)
		}
	default:
		t.Fatal("the output is not closed when Close returns")
	}
}

// onStart is a span processor that calls fn when a span starts.
type onStart func()

func (fn onStart) OnStart(context.Context, sdktrace.ReadWriteSpan) { fn() }
func (onStart) OnEnd(sdktrace.ReadOnlySpan)                        {}
func (onStart) Shutdown(context.Context) error                     { return nil }
func (onStart) ForceFlush(context.Context) error                   { return nil }

// waitDecided waits for a decision on c.
func waitDecided(t *testing.T, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(10 * time.Second):
		t.Fatal("no decision after 10 s: the subscriber never received the message")
	}
}

// Handlers of two topics sharing a Fencer do not wait on each other: here
// a handler publishes, to another topic whose messages have the same
// fence, with gochannel's BlockPublishUntilSubscriberAck, and so waits for
// that topic's handler.
func TestHandlersSharingAFencerDoNotWait(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	g := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer g.Close()
	f := arrivalFencer(t, nil)
	r := fencedRouter(t, f)
	handledB := make(chan struct{})
	r.AddConsumerHandler("a", "a", g, func(msg *message.Message) error {
		return g.Publish("b", stamped("b", stampOf("kb"))) // returns once b's handler acked
	})
	r.AddConsumerHandler("b", "b", g, func(msg *message.Message) error { close(handledB); return nil })
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	published := make(chan error, 1)
	go func() { published <- g.Publish("a", stamped("a", stampOf("ka"))) }()
	select {
	case <-handledB:
	case <-ctx.Done():
		t.Fatal("the handler of b never ran: the handler of a holds the fence while it waits for b")
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A message without a stamp is reported once and acked, without a poison
// queue: nacking it would only have it delivered again at once, for ever.
func TestUnstampedMessageDecidedOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	g := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer g.Close()
	var bad atomic.Int64
	f := arrivalFencer(t, sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		if d.Outcome == sink.BadStamp {
			bad.Add(1)
		}
	}))
	r := fencedRouter(t, f)
	var handled atomic.Int64
	r.AddConsumerHandler("h", "t", g, func(msg *message.Message) error { handled.Add(1); return nil })
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	// Publish returns once the message is acked.
	published := make(chan error, 1)
	go func() { published <- g.Publish("t", message.NewMessage("unstamped", nil)) }()
	select {
	case err := <-published:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatalf("the unstamped message was never acked (%d deliveries so far)", bad.Load())
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n, h := bad.Load(), handled.Load(); n != 1 || h != 0 {
		t.Fatalf("the unstamped message was decided %d times and handled %d times, want once and never", n, h)
	}
}

// With the subscriber decorator and the middleware of one Fencer, each
// delivery is decided and reported once.
func TestSubscriberAndMiddlewareDecideOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	g := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer g.Close()
	var accepted atomic.Int64
	acked := make(chan struct{})
	f := arrivalFencer(t, sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		if d.Outcome == sink.Accepted {
			if accepted.Add(1) == 1 {
				close(acked)
			}
		}
	}))
	r := fencedRouter(t, f)
	r.AddSubscriberDecorators(f.Subscriber())
	r.AddConsumerHandler("h", "t", g, func(msg *message.Message) error { return nil })
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	if err := g.Publish("t", stamped("m", stampOf("k"))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-acked:
	case <-ctx.Done():
		t.Fatal("no accepted decision")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := accepted.Load(); n != 1 {
		t.Fatalf("one message, %d accepted decisions", n)
	}
}
