package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A job stream with MaxAge ages out every message older than it, and a
// schedule is a message: a delayed job due later than MaxAge after its
// enqueue, and a periodic job's schedule once it is older than MaxAge,
// would be dropped by the server without a trace, the delayed job lost
// and the periodic one silent until some process registers it again.
func TestSchedulesOutliveMaxAge(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	e := &env{srv: srv, prefix: "jobs", n: 1}
	e.js = srv.JetStream(t)
	ctx := ctxFor(t, 2*time.Minute)
	if err := worker.ProvisionJobs(ctx, e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: e.n, MaxAge: 2 * time.Second, Duplicates: time.Second, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	e.bucket = e.provisionBucket(t)
	p := e.producer(t)
	delayed, err := worker.Enqueue(ctx, p, "later", email{To: "later"}, worker.EnqueueIn(5*time.Second))
	if err != nil {
		t.Skipf("the stream cannot schedule: %v", err)
	}
	if err := p.Schedule(ctx, worker.Periodic{Kind: "tick", Every: time.Second}); err != nil {
		t.Fatal(err)
	}
	ran := make(chan string, 100)
	mux := worker.NewMux()
	worker.Handle(mux, "later", func(context.Context, *worker.Job, email) error { ran <- "later"; return nil })
	worker.Handle(mux, "tick", func(context.Context, *worker.Job, any) error { ran <- "tick"; return nil })
	start(t, e.config("w", mux))
	gotLater, ticks := false, 0
	deadline := time.After(15 * time.Second) // well past the delayed job's due time and MaxAge
	for !gotLater || ticks < 5 {
		select {
		case what := <-ran:
			if what == "later" {
				gotLater = true
			} else {
				ticks++
			}
		case <-deadline:
			t.Fatalf("after 15 s on a stream of MaxAge 2s: delayed job (due %v) ran: %v; periodic ticks: %d", delayed.Due, gotLater, ticks)
		}
	}
}

// A job stream with MaxAge made before schedules were on gets them, and
// the per-message TTL that exempts them, on the next ProvisionJobs.
func TestMaxAgeStreamUpgradedToSchedules(t *testing.T) {
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	ctx := ctxFor(t, time.Minute)
	cfg := worker.JobsConfig{Prefix: "jobs", Partitions: 1, MaxAge: time.Hour}
	if err := worker.ProvisionJobs(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "jobs", Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.EnqueueIn(time.Hour)); err == nil {
		t.Fatal("a delayed job on a stream without schedules was stored")
	}
	cfg.Schedules = true
	if err := worker.ProvisionJobs(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	p, err = worker.NewProducer(js, worker.ProducerConfig{Prefix: "jobs", Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	e, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.EnqueueIn(2*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, worker.JobsStream("jobs"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.GetMsg(ctx, e.Seq)
	if err != nil {
		t.Fatal(err)
	}
	if ttl := m.Header.Get("Nats-TTL"); ttl != "never" {
		t.Errorf("a schedule due after MaxAge carries Nats-TTL %q; want never", ttl)
	}
}
