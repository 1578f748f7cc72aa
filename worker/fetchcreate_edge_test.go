package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A request to create the job consumer that is lost with the connection
// (sent just before a server restart, as the chaos runs' restarts do) is
// never answered. The fetcher must try again on its own bound, not wait
// out the JetStream context's default timeout (5 s by default, here an
// hour) with the partition's jobs pending.
func TestLostConsumerCreateIsTriedAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, natstest.Listen())
	proxy := natstest.NewProxy(t, e.srv.URL())
	nc, err := nats.Connect(proxy.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithDefaultTimeout(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	var runs runLog
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error { runs.add(j); return nil }))
	cfg.JetStream = js
	cfg.Observer = rec
	start(t, cfg)
	e.enqueue(t, 0, 1)
	rec.waitFor(t, 30*time.Second, "the first job to run", func() bool { return runs.n.Load() >= 1 })

	// Delete the worker's consumer: its pull request ends, and the create
	// of the next one is lost with the connection.
	cut := proxy.CutAt("$JS.API.CONSUMER.CREATE.")
	ctx := ctxFor(t, 30*time.Second)
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	names := s.ConsumerNames(ctx)
	for name := range names.Name() {
		if err := s.DeleteConsumer(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cut:
	case <-ctx.Done():
		t.Fatal("no consumer create was sent after the worker's consumer was deleted")
	}
	e.enqueue(t, 1, 1)
	rec.waitFor(t, 30*time.Second, "the next job to run after the create was lost with the connection", func() bool { return runs.n.Load() >= 2 })
}
