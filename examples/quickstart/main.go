// Command quickstart: a job stream, a producer, a worker serving two kinds of job, a fenced sink, the status page.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/worker"
)

type Email struct{ To string }
type Invoice struct{ Number, Cents int }

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url, opts := os.Getenv("NATS_URL"), []nats.Option{} // a given server, or one embedded here
	if url == "" {
		dir := must(os.MkdirTemp("", "quickstart"))
		defer os.RemoveAll(dir)
		srv := must(server.NewServer(&server.Options{JetStream: true, StoreDir: dir, DontListen: true}))
		srv.Start()
		defer srv.Shutdown()
		opts = append(opts, nats.InProcessServer(srv))
	}
	nc := must(nats.Connect(url, opts...))
	defer nc.Close()
	js := must(jetstream.New(nc))
	check(worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "shop", Partitions: 4, Schedules: true}))
	leases := must(coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "shop-leases"}))
	page := must(statuspage.Serve(ctx, statuspage.ServeConfig{JetStream: js, Bucket: leases, Prefix: "shop", Addr: os.Getenv("HTTP_ADDR")}))
	defer page.Close() // one call: events, and the page, /metrics and /readyz on $HTTP_ADDR (e.g. :8080) if set
	kv := must(kvsink.New(ctx, js, kvsink.Config{Bucket: "shop-sink", Observer: page.SinkObserver(), Telemetry: page.Telemetry()}))
	mux := worker.NewMux() // a typed handler per kind; kv refuses stale epochs
	worker.Handle(mux, "email", func(ctx context.Context, j *worker.Job, e Email) error {
		return j.Apply(ctx, kv, "email."+e.To, []byte("sent")) // stamped with the lease's epoch
	})
	worker.Handle(mux, "invoice", func(ctx context.Context, j *worker.Job, in Invoice) error {
		return j.Apply(ctx, kv, "invoice."+strconv.Itoa(in.Number), []byte(strconv.Itoa(in.Cents)))
	})
	w := must(worker.New(worker.Config{JetStream: js, Prefix: "shop", Partitions: 4, Bucket: leases,
		Handler: mux, Fences: []worker.Fence{kv}, Observer: page.WorkerObserver(nil), Telemetry: page.Telemetry()}))
	wctx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(wctx) }()
	p := must(worker.NewProducer(js, worker.ProducerConfig{Prefix: "shop", Partitions: 4, Bucket: leases}))
	var jobs []worker.Enqueued
	for n := range 3 {
		jobs = append(jobs, must(worker.Enqueue(ctx, p, "email", Email{To: "user" + strconv.Itoa(n)})),
			must(worker.Enqueue(ctx, p, "invoice", Invoice{n, 100 * n}, worker.EnqueueIn(time.Second))))
	}
	for _, st := range must(p.Wait(ctx, jobs...)) { // until every job is done
		fmt.Printf("job %s (partition:sequence): %s\n", st.Ref, st.State)
	}
	stop()
	check(<-stopped) // it finished its jobs, committed and released its partitions
	e, _, err := kv.Get(ctx, "invoice.2")
	check(err)
	fmt.Printf("sink: invoice.2 = %s (partition %d, epoch %d)\n", e.Data, e.Stamp.Partition, e.Stamp.Epoch)
}

func must[T any](v T, err error) T {
	check(err)
	return v
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
