package streamsink_test

import (
	"context"
	"log"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
)

// Consume the workers' effect log and hand each accepted effect, in log
// order, to a function; stale effects never reach it.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	r, err := streamsink.New(ctx, js, streamsink.Config{
		Handler: func(ctx context.Context, e sink.Effect) error {
			log.Printf("apply %s to %s", e.Stamp.Key, e.Subject)
			return nil // must be idempotent by e.Stamp.Key
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := r.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
