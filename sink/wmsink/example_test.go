package wmsink_test

import (
	"log"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink/wmsink"
)

// Fence every handler of a router: stale messages are acked and dropped
// before the handler runs. The subscriber is built with the Fencer's
// Unmarshaler, so that each message carries its position in its stream,
// and the Fencer judges it there, however late it is delivered again.
func ExampleFencer_Middleware() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	f, err := wmsink.New(wmsink.Config{JetStream: js})
	if err != nil {
		log.Fatal(err)
	}
	subConn, err := nats.Connect(nats.DefaultURL) // the subscriber closes it
	if err != nil {
		log.Fatal(err)
	}
	logger := watermill.NopLogger{}
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{Conn: subConn, Logger: logger, Unmarshaler: f.Unmarshaler(nil)})
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(f.Middleware)
	router.AddConsumerHandler("orders", "effects", sub, func(msg *message.Message) error {
		// Write msg.Payload: its stamp is current at its place in the stream.
		return nil
	})
	_ = router // router.Run(ctx)
}
