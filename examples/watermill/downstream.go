package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/worker"
)

// downstream is the Watermill side: an in-process pub/sub whose Publish
// returns once the subscriber has acked, and the router, whose handler the
// fencing middleware guards.
type downstream struct {
	pubsub *gochannel.GoChannel
	fencer *wmsink.Fencer
	router *message.Router
	done   chan error
}

func startDownstream(ctx context.Context, cfg config, tr *tracker) (*downstream, error) {
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if cfg.Logger.Enabled(ctx, slog.LevelInfo) {
		logger = watermill.NewSlogLogger(cfg.Logger)
	}
	d := &downstream{pubsub: gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger), done: make(chan error, 1)}
	// gochannel carries no log position: the middleware judges in arrival
	// order, which is safe here because nothing is redelivered.
	var err error
	d.fencer, err = wmsink.New(wmsink.Config{ArrivalOrder: true, Name: "watermill", Observer: tr.fenceObserver(), Logger: cfg.Logger})
	if err != nil {
		d.pubsub.Close()
		return nil, err
	}
	d.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		d.pubsub.Close()
		return nil, err
	}
	d.router.AddMiddleware(d.fencer.Middleware)
	d.router.AddConsumerHandler("ship", topic, d.pubsub, (&warehouse{tr: tr}).ship)
	go func() { d.done <- d.router.Run(context.WithoutCancel(ctx)) }()
	return d, nil
}

// close stops the router, waits for it, and closes the pub/sub.
func (d *downstream) close() error {
	var err error
	if cerr := d.router.Close(); cerr != nil {
		err = fmt.Errorf("close the router: %w", cerr)
	}
	if rerr := <-d.done; rerr != nil && err == nil {
		err = fmt.Errorf("router: %w", rerr)
	}
	d.pubsub.Close()
	return err
}

// introduce says what the example is made of.
func introduce(s *script, srv *natsServer, cfg config, leftover uint64) {
	s.printf("leasehold example: Watermill, stamped upstream and fenced downstream\n")
	s.say("NATS        %s: job stream %s (%d partitions), lease bucket %s-leases", srv.desc, worker.JobsStream(cfg.Prefix), cfg.Partitions, cfg.Prefix)
	if leftover > 0 {
		s.say("            (purged the %s of an earlier run from the job stream)", count(int(leftover), "job"))
	}
	s.say("Watermill   a gochannel pub/sub, topic %q", topic)
	s.say("upstream    leasehold workers; each job publishes one message through")
	s.say("            wmstamp.NewPublisher(pubsub): the message is created with the handler's ctx,")
	s.say("            and the publisher writes the job's stamp into its metadata")
	s.say("            (Leasehold-Partition, Leasehold-Epoch, Leasehold-Key, Leasehold-Worker)")
	s.say("downstream  a Watermill router whose handler is wrapped in wmsink's fencing middleware;")
	s.say("            it records each shipment by its idempotency key")
}
