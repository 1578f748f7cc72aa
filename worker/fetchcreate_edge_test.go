package worker_test

import (
	"context"
	"testing"
	"time"

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
	proxy, nc, _, _ := e.proxied(t)
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

// The same for the watch of the partition's cancels, which the runner
// reads before its first job: a lookup of the bucket or a create of the
// watch's consumer lost with the connection is tried again, and the jobs
// then run checked against the cancels stored before. Neither a wait
// without end nor jobs run uncancellable.
func TestLostCancelWatchIsTriedAgain(t *testing.T) {
	t.Parallel()
	for name, at := range map[string]string{
		"lookup": "$JS.API.STREAM.INFO.KV_" + worker.CancelBucket("jobs"),
		"watch":  "$JS.API.CONSUMER.CREATE.KV_" + worker.CancelBucket("jobs"),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1, natstest.Listen())
			proxy, nc, _, _ := e.proxied(t)
			js, err := jetstream.New(nc, jetstream.WithDefaultTimeout(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			ctx := ctxFor(t, time.Minute)
			p := e.statusProducer(t)
			cancelled, err := p.EnqueueTo(ctx, 0, []byte("cancelled"))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.Cancel(ctx, cancelled); err != nil {
				t.Fatal(err)
			}
			next, err := p.EnqueueTo(ctx, 0, []byte("next"))
			if err != nil {
				t.Fatal(err)
			}
			var runs runLog
			cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error { runs.add(j); return nil }))
			cfg.JetStream = js
			cut := proxy.CutAt(at)
			start(t, cfg)
			select {
			case <-cut:
			case <-ctx.Done():
				t.Fatalf("no request with %q was sent", at)
			}
			sts, err := p.Wait(ctx, next, cancelled)
			if err != nil {
				t.Fatalf("the jobs did not finish after the request was lost with the connection: %v", err)
			}
			if sts[0].State != worker.JobDone || sts[1].State != worker.JobCancelled {
				t.Fatalf("Wait says %+v: want done, then cancelled", sts)
			}
			for _, h := range runs.all() {
				if h.Data == "cancelled" {
					t.Fatal("the cancelled job ran: the partition ran its jobs without reading its cancels")
				}
			}
		})
	}
}
