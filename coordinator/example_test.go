package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/embedded"
)

// A lock on a named resource: A takes it, B waits, A hands it off, and B
// holds it with a higher fencing token, which it puts into every write it
// makes (l.Info().Stamp(key)) so that sinks refuse A's late writes.
func ExampleCoordinator_Lock() {
	js, stop := exampleNATS() // in production: nats.Connect(url), then jetstream.New(nc)
	defer stop()
	ctx := context.Background()
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "reports-leases", Logger: quiet})
	if err != nil {
		panic(err)
	}
	a, _ := coordinator.New(bucket, coordinator.Config{Worker: "a", Logger: quiet})
	b, _ := coordinator.New(bucket, coordinator.Config{Worker: "b", Logger: quiet})

	la, err := a.Lock(ctx, "report-generator")
	if err != nil {
		panic(err)
	}
	fmt.Println("A holds", la.Name(), "in scope", la.Info().Scope)

	_, err = b.TryLock(ctx, "report-generator")
	fmt.Println("B refused:", errors.Is(err, coordinator.ErrHeld))
	got := make(chan *coordinator.Lease)
	go func() {
		lb, err := b.Lock(ctx, "report-generator") // waits for the release
		if err != nil {
			panic(err)
		}
		got <- lb
	}()

	// B waits on a watch of the lock's key: the release wakes it at once.
	if err := la.Release(ctx); err != nil {
		panic(err)
	}
	lb := <-got
	defer lb.Release(ctx)
	fmt.Println("B holds", lb.Name(), "with a higher token:", lb.Epoch() > la.Epoch())
	// Output:
	// A holds report-generator in scope reports/report-generator
	// B refused: true
	// B holds report-generator with a higher token: true
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func exampleNATS() (jetstream.JetStream, func()) {
	dir, err := os.MkdirTemp("", "leasehold-example")
	if err != nil {
		panic(err)
	}
	srv, err := embedded.Start(embedded.Config{Name: "example", StoreDir: dir})
	if err != nil {
		panic(err)
	}
	nc, err := nats.Connect("", nats.InProcessServer(srv))
	if err != nil {
		panic(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		panic(err)
	}
	return js, func() {
		nc.Close()
		srv.Shutdown()
		srv.WaitForShutdown()
		os.RemoveAll(dir)
	}
}
