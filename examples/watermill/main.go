// Command watermill: workers publish through a Watermill publisher stamped by
// worker/wmstamp to a JetStream stream, read by a router behind sink/wmsink's
// fencing middleware, which judges each message at its position in the stream.
// worker-a's message for o-2 hangs in the network; worker-b takes over and
// ships o-2 again; the stale message, stored after worker-b's barrier, is
// dropped. `go run ./examples/watermill` runs it on an embedded NATS server,
// or on $NATS_URL.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/wmstamp"
)

type Order struct{ ID string }

type shipment struct {
	order string
	stamp leasehold.Stamp
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout, os.Getenv("NATS_URL")); err != nil {
		log.Fatal(err)
	}
}

// run plays the example and returns the message the middleware dropped.
func run(ctx context.Context, out io.Writer, url string) (sink.Decision, error) {
	say := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	var drop sink.Decision
	opts := []nats.Option{}
	if url == "" {
		dir, err := os.MkdirTemp("", "watermill")
		if err != nil {
			return drop, err
		}
		defer os.RemoveAll(dir)
		srv, err := server.NewServer(&server.Options{JetStream: true, StoreDir: dir, DontListen: true, NoSigs: true})
		if err != nil {
			return drop, err
		}
		srv.Start()
		defer srv.Shutdown()
		opts = append(opts, nats.InProcessServer(srv))
	}
	connect := func() (*nats.Conn, error) { return nats.Connect(url, opts...) }
	nc, err := connect()
	if err != nil {
		return drop, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return drop, err
	}
	// One partition; the effects are Watermill messages on the shipments stream.
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "shipping", Partitions: 1, NoEffects: true}); err != nil {
		return drop, err
	}
	leases, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "shipping-leases"})
	if err != nil {
		return drop, err
	}
	// The fencer judges messages by position: the stream keeps every one.
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "shipments", Subjects: []string{"shipments"}}); err != nil {
		return drop, err
	}

	// Downstream: a router whose handler sees only messages of a current epoch.
	// The subscriber hands the fencer each message's stream position
	// (fencer.Unmarshaler), so a message nacked before a take-over and
	// delivered again after it is judged where it stands: before the take-over.
	shipped, dropped := make(chan shipment, 16), make(chan sink.Decision, 1)
	fencer, err := wmsink.New(wmsink.Config{JetStream: js, Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		if d.Outcome.Dropped() {
			dropped <- d
		}
	})})
	if err != nil {
		return drop, err
	}
	subConn, err := connect() // the subscriber drains it when it closes
	if err != nil {
		return drop, err
	}
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{Conn: subConn, Logger: watermill.NopLogger{},
		Unmarshaler: fencer.Unmarshaler(nil), ResourceInitializer: fromNow})
	if err != nil {
		subConn.Close()
		return drop, err
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return drop, err
	}
	router.AddMiddleware(fencer.Middleware)
	router.AddConsumerHandler("ship", "shipments", sub, func(m *message.Message) error {
		st, err := leasehold.StampFromMetadata(m.Metadata)
		var o Order
		if err == nil {
			err = json.Unmarshal(m.Payload, &o)
		}
		shipped <- shipment{o.ID, st}
		return err
	})
	routed := make(chan error, 1)
	go func() { routed <- router.Run(context.WithoutCancel(ctx)) }()
	defer func() { router.Close(); <-routed }()
	<-router.Running()

	wmpub, err := wmjs.NewPublisher(wmjs.PublisherConfig{Conn: nc, Logger: watermill.NopLogger{}})
	if err != nil {
		return drop, err
	}

	// Upstream: workers publish one stamped message per order, and a barrier
	// when they take the partition. The network holds worker-a's o-2 until wake.
	held, wake := make(chan leasehold.Stamp, 1), make(chan struct{})
	network := publishFunc(func(topic string, msgs ...*message.Message) error {
		if m := msgs[0]; m.Metadata.Get(leasehold.HeaderWorker) == "worker-a" && string(m.Payload) == `{"ID":"o-2"}` {
			st, _ := leasehold.StampFromMetadata(m.Metadata)
			held <- st
			<-wake
		}
		return wmpub.Publish(topic, msgs...)
	})
	pub := wmstamp.NewPublisher(network, wmstamp.Config{})
	mux := worker.NewMux()
	worker.Handle(mux, "ship", func(ctx context.Context, _ *worker.Job, o Order) error {
		payload, _ := json.Marshal(o)
		return pub.Publish("shipments", message.NewMessageWithContext(ctx, watermill.NewUUID(), payload)) // ctx: the job's stamp
	})
	start := func(name string) (context.CancelFunc, chan error, error) {
		w, err := worker.New(worker.Config{JetStream: js, Prefix: "shipping", Partitions: 1, Bucket: leases, Handler: mux,
			Order:           worker.OrderPartition, // one job at a time: o-3 waits behind the o-2 the network holds
			BarrierSubjects: func(leasehold.Partition) []string { return []string{"shipments"} },
			Coordinator:     coordinator.Config{Worker: name, ShutdownTimeout: time.Second, RebalanceDelay: 100 * time.Millisecond}})
		wctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		if err == nil {
			go func() { done <- w.Run(wctx) }()
		}
		return stop, done, err
	}
	seen := map[string]bool{} // idempotency keys: a job run again after a take-over ships once
	next := func(what string) error {
		for {
			select {
			case s := <-shipped:
				if !seen[s.stamp.Key] {
					seen[s.stamp.Key] = true
					say("   downstream shipped %s from %s (epoch %d, key %s)", s.order, s.stamp.Worker, s.stamp.Epoch, s.stamp.Key)
					return nil
				}
			case <-ctx.Done():
				return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
			}
		}
	}

	say("1. worker-a takes the partition; o-1, o-2 and o-3 are enqueued")
	stopA, doneA, err := start("worker-a")
	if err != nil {
		return drop, err
	}
	defer stopA()
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "shipping", Partitions: 1, Bucket: leases})
	if err != nil {
		return drop, err
	}
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		if _, err := worker.Enqueue(ctx, p, "ship", Order{id}); err != nil {
			return drop, err
		}
	}
	if err := next("o-1"); err != nil {
		return drop, err
	}
	var stale leasehold.Stamp
	select {
	case stale = <-held:
	case <-ctx.Done():
		return drop, ctx.Err()
	}
	say("2. worker-a's message for o-2 (epoch %d) hangs in the network", stale.Epoch)

	say("3. worker-a is told to stop; its drain gives up on the stuck handler and releases; worker-b takes over")
	stopA()
	stopB, doneB, err := start("worker-b")
	if err != nil {
		return drop, err
	}
	defer stopB()
	for _, id := range []string{"o-2", "o-3"} {
		if err := next(id); err != nil {
			return drop, err
		}
	}

	say("4. the network delivers worker-a's stale message for o-2")
	close(wake)
	select {
	case drop = <-dropped:
	case s := <-shipped:
		return drop, fmt.Errorf("the stale message was not dropped: the handler ran for %s from %s under epoch %d", s.order, s.stamp.Worker, s.stamp.Epoch)
	case <-ctx.Done():
		return drop, ctx.Err()
	}
	say("   the middleware dropped it (acked, handler not called): %v", drop.Err)
	if err := <-doneA; err != nil {
		return drop, fmt.Errorf("worker-a: %w", err)
	}
	stopB()
	return drop, <-doneB
}

// fromNow consumes the shipments stream from the subscription on.
func fromNow(ctx context.Context, js jetstream.JetStream, topic string) (jetstream.Consumer, func(context.Context, watermill.LoggerAdapter), error) {
	c, err := js.CreateOrUpdateConsumer(ctx, topic, jetstream.ConsumerConfig{AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverNewPolicy})
	return c, nil, err
}

// publishFunc is a message.Publisher made of a function.
type publishFunc func(topic string, msgs ...*message.Message) error

func (f publishFunc) Publish(topic string, msgs ...*message.Message) error { return f(topic, msgs...) }
func (f publishFunc) Close() error                                         { return nil }
