package wmsink_test

import (
	"log"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/leasehold/leasehold/sink/wmsink"
)

// Fence every handler of a router: stale messages are acked and dropped
// before the handler runs. gochannel gives no log positions, so the Fencer
// judges in arrival order.
func ExampleFencer_Middleware() {
	logger := watermill.NopLogger{}
	sub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	f, err := wmsink.New(wmsink.Config{ArrivalOrder: true})
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(f.Middleware)
	router.AddConsumerHandler("orders", "effects", sub, func(msg *message.Message) error {
		// Write msg.Payload: its stamp is current.
		return nil
	})
	_ = router // router.Run(ctx)
}
