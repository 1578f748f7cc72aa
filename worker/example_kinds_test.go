package worker_test

import (
	"context"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// One worker serving two kinds of job, each with its own typed handler; a
// typed producer; a delayed job run by the server's scheduler; and
// Producer.Wait for all of them to be done.
func ExampleMux() {
	js, stop := exampleNATS()
	defer stop()
	ctx := context.Background()
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "shop", Partitions: 1, Schedules: true}); err != nil {
		panic(err)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "shop-leases"})
	if err != nil {
		panic(err)
	}

	type Email struct{ To string }
	type Refund struct{ Order, Cents int }
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(ctx context.Context, job *worker.Job, e Email) error {
		fmt.Println("email to", e.To)
		return job.Emit(ctx, []byte(e.To))
	})
	worker.Handle(mux, "refund", func(ctx context.Context, job *worker.Job, r Refund) error {
		fmt.Printf("refund %d cents on order %d\n", r.Cents, r.Order)
		return job.Emit(ctx, []byte(fmt.Sprint(r.Order)))
	})
	runCtx, cancel := context.WithCancel(ctx)
	w, err := worker.New(worker.Config{JetStream: js, Prefix: "shop", Partitions: 1, Bucket: bucket, Handler: mux, Logger: quiet})
	if err != nil {
		panic(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()

	producer, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "shop", Partitions: 1, Bucket: bucket})
	if err != nil {
		panic(err)
	}
	refund, err := worker.Enqueue(ctx, producer, "refund", Refund{Order: 17, Cents: 250}, worker.EnqueueIn(time.Second))
	if err != nil {
		panic(err)
	}
	email, err := worker.Enqueue(ctx, producer, "email", Email{To: "ann@example.com"})
	if err != nil {
		panic(err)
	}
	statuses, err := producer.Wait(ctx, email, refund)
	if err != nil {
		panic(err)
	}
	fmt.Println(statuses[0].State, statuses[1].State)
	cancel()
	if err := <-done; err != nil {
		panic(err)
	}
	// Output:
	// email to ann@example.com
	// refund 250 cents on order 17
	// done done
}
