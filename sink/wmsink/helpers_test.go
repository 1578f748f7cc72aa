package wmsink_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker/wmstamp"
)

// Set-up the tests of this package share: fencers and routers, the
// effect-log case the redelivery tests replay, and the bare and wrapped
// runs of watermill's pub/sub suite.

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// fencedRouter is a Router whose handlers f fences.
func fencedRouter(t *testing.T, f *wmsink.Fencer) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(f.Middleware)
	return r
}

// runBareAndWrapped runs watermill's pub/sub suite on a backend bare, then
// wrapped: its publishers stamping with a lock's lease and its subscribers
// fenced, unmarshalling with what unmarshaler makes of the Fencer. The
// cases in skip do not run.
func runBareAndWrapped[U any](t *testing.T, srv *natstest.Server, features tests.Features, backend func(U) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor), unmarshaler func(*wmsink.Fencer) U, skip map[string]bool) {
	t.Run("bare", func(t *testing.T) {
		var bare U
		pubsub, groups := backend(bare)
		runSuite(t, features, pubsub, groups, skip)
	})
	t.Run("wrapped", func(t *testing.T) {
		f, err := wmsink.New(wmsink.Config{JetStream: srv.JetStream(t), Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		w := wrap{lease: suiteLease(t, srv), f: f}
		pubsub, groups := backend(unmarshaler(f))
		runSuite(t, features, func(t *testing.T) (message.Publisher, message.Subscriber) {
			return w.pair(t, func() (message.Publisher, message.Subscriber) { return pubsub(t) })
		}, func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return w.pair(t, func() (message.Publisher, message.Subscriber) { return groups(t, group) })
		}, skip)
	})
}

func arrivalFencer(t *testing.T, obs sink.Observer) *wmsink.Fencer {
	t.Helper()
	f, err := wmsink.New(wmsink.Config{UnsafeArrivalOrder: true, Logger: quiet(), Observer: obs})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func stamped(uuid string, s leasehold.Stamp) *message.Message {
	m := message.NewMessage(uuid, []byte(uuid))
	s.SetMetadata(m.Metadata)
	return m
}

func stampOf(key string) leasehold.Stamp {
	return leasehold.Stamp{Scope: "orders", Partition: 0, Epoch: 1, Acquisition: "a1", Key: key, Worker: "w"}
}

// wrap stamps and fences a backend's publisher and subscriber.
type wrap struct {
	lease *coordinator.Lease
	f     *wmsink.Fencer
}

func (w wrap) pair(t *testing.T, backend func() (message.Publisher, message.Subscriber)) (message.Publisher, message.Subscriber) {
	t.Helper()
	pub, sub := backend()
	fenced, err := w.f.Subscriber()(sub)
	if err != nil {
		t.Fatal(err)
	}
	return wmstamp.NewPublisher(pub, wmstamp.Config{Lease: w.lease}), fenced
}

// suiteLease takes a lock for the wrapped publishers to stamp with.
func suiteLease(t *testing.T, srv *natstest.Server) *coordinator.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b, err := coordinator.Provision(ctx, srv.JetStream(t), coordinator.BucketConfig{Bucket: "suite-locks", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c, err := coordinator.New(b, coordinator.Config{Worker: "publisher"})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.TryLock(ctx, "suite")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	return l
}

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
	r := fencedRouter(t, f)
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
