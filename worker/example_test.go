package worker_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/embedded"
	"github.com/leasehold/leasehold/worker"
)

// Enqueue jobs, then run a worker whose handler emits one stamped effect
// per job. The jobs of one key run one after another, in the order they
// were enqueued; jobs of other keys would run beside them.
func Example() {
	js, stop := exampleNATS() // in production: nats.Connect(url), then jetstream.New(nc)
	defer stop()
	ctx := context.Background()

	// Once per deployment (or `leasehold init`): the job streams and the
	// lease bucket.
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "orders", Partitions: 1}); err != nil {
		panic(err)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases"})
	if err != nil {
		panic(err)
	}

	producer, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "orders", Partitions: 1})
	if err != nil {
		panic(err)
	}
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		// The key picks the partition and orders the customer's jobs; the
		// job ID makes retries safe.
		if _, err := producer.Enqueue(ctx, []byte("customer-7"), []byte(id), worker.JobID(id)); err != nil {
			panic(err)
		}
	}

	runCtx, cancel := context.WithCancel(ctx)
	handled := 0
	w, err := worker.New(worker.Config{
		JetStream:  js,
		Prefix:     "orders",
		Partitions: 1,
		Bucket:     bucket,
		Handler: worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
			fmt.Printf("order %s, attempt %d\n", job.Data, job.Attempt)
			if handled++; handled == 3 {
				cancel() // shut down gracefully after the third job
			}
			// Stamped with partition, epoch and the key orders.0.<seq>.0.
			return job.Emit(ctx, []byte("shipped "+string(job.Data)))
		}),
		Logger: quiet,
	})
	if err != nil {
		panic(err)
	}
	if err := w.Run(runCtx); err != nil {
		panic(err)
	}
	// Output:
	// order o-1, attempt 1
	// order o-2, attempt 1
	// order o-3, attempt 1
}

// A typed handler: payloads are decoded from JSON, and one that does not
// decode is dead-lettered at once instead of being retried.
func ExampleJSON() {
	js, stop := exampleNATS()
	defer stop()
	ctx := context.Background()
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "payments", Partitions: 1}); err != nil {
		panic(err)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "payments-leases"})
	if err != nil {
		panic(err)
	}
	producer, _ := worker.NewProducer(js, worker.ProducerConfig{Prefix: "payments", Partitions: 1})
	for _, body := range []string{`{"id":"p-1","cents":1250}`, `{"id":"p-2","cents":`, `{"id":"p-3","cents":99}`} {
		if _, err := producer.EnqueueTo(ctx, 0, []byte(body)); err != nil {
			panic(err)
		}
	}

	type payment struct {
		ID    string `json:"id"`
		Cents int    `json:"cents"`
	}
	runCtx, cancel := context.WithCancel(ctx)
	seen := 0
	done := func() {
		if seen++; seen == 3 {
			cancel()
		}
	}
	w, err := worker.New(worker.Config{
		JetStream:  js,
		Prefix:     "payments",
		Partitions: 1,
		Bucket:     bucket,
		Handler: worker.JSON(func(ctx context.Context, job *worker.Job, p payment) error {
			fmt.Printf("charge %s: %d cents\n", p.ID, p.Cents)
			done()
			return nil
		}),
		Observer: worker.ObserverFunc(func(_ context.Context, e worker.Event) {
			if e.Kind == worker.EventJobDeadLettered {
				fmt.Printf("job %d dead-lettered to %s\n", e.Seq, e.Subject)
				done()
			}
		}),
		Logger: quiet,
	})
	if err != nil {
		panic(err)
	}
	if err := w.Run(runCtx); err != nil {
		panic(err)
	}
	// Output:
	// charge p-1: 1250 cents
	// job 2 dead-lettered to payments.dlq.0
	// charge p-3: 99 cents
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// exampleNATS starts an embedded NATS server with JetStream in a
// temporary directory.
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
