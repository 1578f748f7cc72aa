package kvsink_test

import (
	"context"
	"errors"
	"log"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// Fenced writes into a KV bucket, with epochs verified against the lease
// bucket.
func Example() {
	ctx := context.Background()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	leases, err := coordinator.OpenBucket(ctx, js, "")
	if err != nil {
		log.Fatal(err)
	}
	s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "orders", Verifier: leases})
	if err != nil {
		log.Fatal(err)
	}
	// A worker's lease on partition 3 of the job stream; a lock holder's
	// lease works the same way.
	lease := leasehold.Lease{Scope: leases.Scope(), Partition: 3, Epoch: 42, Acquisition: "a42", Holder: "w1"}
	err = s.Apply(ctx, sink.Effect{Stamp: lease.Stamp("orders.3.17.0"), Subject: "order.17", Data: []byte("paid")})
	if errors.Is(err, leasehold.ErrStaleEpoch) {
		log.Print("this worker lost partition 3; the write was not applied")
	}
}
