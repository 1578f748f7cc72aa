package statuspage_test

import (
	"context"
	"net/http"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// A worker of your own that publishes its take-overs and losses, and
// serves the status page beside /metrics, /livez and /readyz.
func Example() {
	ctx := context.Background()
	var (
		js     jetstream.JetStream // connected
		bucket *coordinator.Bucket // coordinator.OpenBucket
		cfg    worker.Config       // your worker's configuration
	)
	events := statuspage.NewPublisher(statuspage.PublisherConfig{JetStream: js, Prefix: cfg.Prefix, Source: cfg.Coordinator.Worker})
	defer events.Close()
	cfg.Observer = events.WorkerObserver(cfg.Observer)
	// A sink's observers take events.SinkObserver() the same way.

	mux := telemetry.Mux(nil)
	page := statuspage.New(statuspage.Config{
		JetStream: js, Bucket: bucket, Prefix: cfg.Prefix, ServedBy: cfg.Coordinator.Worker, Lag: true,
		DeadLetters: statuspage.DefaultDeadLetters(cfg.Prefix, true, false),
	})
	page.Register(mux)
	go page.Run(ctx) // until ctx ends; open pages end with it
	_ = http.ListenAndServe(":8080", mux)
}
