package worker_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A periodic job's definition the server cannot run (a time zone it does
// not know, a cron it cannot parse) must fail Schedule, not be stored as
// a schedule the server drops when it falls due, silently.
func TestPeriodicTheServerCannotRun(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	p := e.producer(t)
	for _, pj := range []worker.Periodic{
		{Name: "tz", Kind: "report", Cron: "@hourly", TimeZone: "Nowhere/Atlantis"},
		{Name: "cron", Kind: "report", Cron: "0 61 * * * *"},
		{Name: "words", Kind: "report", Cron: "every tuesday"},
	} {
		if err := p.Schedule(ctx, pj); err == nil {
			t.Errorf("Schedule(%+v) stored it", pj)
		}
	}
}

// A job stream with MaxAge and schedules allows per-message TTLs (for the
// schedules), so a Nats-TTL header on a job would have the server delete
// it unhandled once it expires: the producer refuses one.
func TestEnqueueWithATTLHeader(t *testing.T) {
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	ctx := ctxFor(t, time.Minute)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "jobs", Partitions: 1, MaxAge: time.Hour, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "jobs", Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	if e, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.WithHeader(nats.Header{"Nats-Ttl": []string{"1s"}})); err == nil {
		t.Fatalf("a job with Nats-TTL 1s was stored: %+v", e)
	}
}
