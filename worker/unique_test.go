package worker_test

import (
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

type emailArgs struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
}

func asDuplicate(t *testing.T, err error) *worker.DuplicateJobError {
	t.Helper()
	var dup *worker.DuplicateJobError
	if !errors.Is(err, worker.ErrDuplicateJob) || !errors.As(err, &dup) {
		t.Fatalf("err = %v, want one matching worker.ErrDuplicateJob", err)
	}
	return dup
}

// A unique job is stored once per kind and arguments (or per key) within
// its period, across producers and a server restart; the refusal names
// the job stored first.
func TestUniqueJobIsStoredOnce(t *testing.T) {
	e := newEnv(t, 4)
	ctx := ctxFor(t, 60*time.Second)
	a, b := e.producer(t), e.producer(t)
	args := emailArgs{To: "ann@example.com", Subject: "welcome"}
	first, err := worker.Enqueue(ctx, a, "email", args, worker.Unique(24*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	_, err = worker.Enqueue(ctx, b, "email", args, worker.Unique(24*time.Hour))
	dup := asDuplicate(t, err)
	if dup.Existing.Partition != first.Partition || dup.Existing.Seq != first.Seq || dup.Existing.ID != first.ID {
		t.Fatalf("the refusal names %+v, want the first job %+v", dup.Existing, first)
	}
	// Other arguments, another kind, or no uniqueness asked: stored.
	if _, err := worker.Enqueue(ctx, b, "email", emailArgs{To: "bob@example.com", Subject: "welcome"}, worker.Unique(24*time.Hour)); err != nil {
		t.Fatalf("other arguments: %v", err)
	}
	if _, err := worker.Enqueue(ctx, b, "sms", args, worker.Unique(24*time.Hour)); err != nil {
		t.Fatalf("another kind: %v", err)
	}
	if _, err := worker.Enqueue(ctx, b, "email", args); err != nil {
		t.Fatalf("without uniqueness: %v", err)
	}
	// A key the producer gives, whatever the payload.
	k1, err := a.Enqueue(ctx, []byte("k"), []byte("one"), worker.UniqueKey("invoice-7", time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Enqueue(ctx, []byte("other"), []byte("two"), worker.UniqueKey("invoice-7", time.Hour))
	if dup := asDuplicate(t, err); dup.Existing.Seq != k1.Seq {
		t.Fatalf("the key's refusal names %+v, want %+v", dup.Existing, k1)
	}

	e.srv.Restart(t)
	e.js = e.srv.JetStream(t) // the in-process connection did not survive
	c := e.producer(t)
	_, err = worker.Enqueue(ctx, c, "email", args, worker.Unique(24*time.Hour))
	if dup := asDuplicate(t, err); dup.Existing.Seq != first.Seq {
		t.Fatalf("after a restart the refusal names %+v, want %+v", dup.Existing, first)
	}
	if _, err := worker.Enqueue(ctx, c, "email", args, worker.Unique(0)); err == nil {
		t.Fatal("a period of 0 was accepted")
	}
	if err := c.Batch().Enqueue(ctx, []byte("k"), []byte("x"), worker.Unique(time.Hour)); err == nil {
		t.Fatal("a batch took a unique job")
	}
}

// Uniqueness ends with its period: once the key's TTL has run out (the
// server's expiry marker is the event waited on), the same job is stored
// again.
func TestUniqueEndsWithItsPeriod(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	p := e.producer(t)
	kv, err := e.js.KeyValue(ctx, worker.UniqueBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	w, err := kv.WatchAll(ctx, jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	if _, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.UniqueKey("report", time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.UniqueKey("report", time.Second)); !errors.Is(err, worker.ErrDuplicateJob) {
		t.Fatalf("a copy within the period: %v", err)
	}
	for expired := false; !expired; {
		select {
		case en := <-w.Updates():
			expired = en != nil && en.Operation() != jetstream.KeyValuePut
		case <-ctx.Done():
			t.Fatal("the unique key never expired")
		}
	}
	if _, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.UniqueKey("report", time.Second)); err != nil {
		t.Fatalf("after the period: %v", err)
	}
}

// A producer that died between reserving a uniqueness and recording its
// job leaves a reservation without a job: it refuses copies while young
// (another producer may still be storing the job), and is taken over once
// older than the producer's bound, so it does not hold the key for the
// whole period. A forged value holds the key but is reported as such.
func TestUniqueReservationOfACrashedProducer(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	// Free the key (bound: 3s) and put a crashed producer's reservation
	// in its place.
	p, kv, name := freedUniqueness(t, ctx, e, time.Hour)
	res, _ := json.Marshal(map[string]any{"id": "crashed-1", "partition": 1})
	put, err := kv.Create(ctx, name, res, jetstream.KeyTTL(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.EnqueueTo(ctx, 0, []byte("x"), worker.UniqueKey("nightly", time.Hour))
	if dup := asDuplicate(t, err); dup.Existing.Seq != 0 || dup.Existing.ID != "crashed-1" || dup.Existing.Partition != 1 {
		t.Fatalf("a young reservation: the refusal names %+v, want ID crashed-1 on partition 1, not stored yet", dup.Existing)
	}
	// The producer that reserved it retrying under its own job ID takes
	// it at once.
	own, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.JobID("crashed-1"), worker.UniqueKey("nightly", time.Hour))
	if err != nil || own.ID != "crashed-1" {
		t.Fatalf("its own retry: %+v, %v", own, err)
	}
	en, err := kv.Get(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		Seq uint64 `json:"seq"`
	}
	if err := json.Unmarshal(en.Value(), &rec); err != nil || rec.Seq != own.Seq || en.Revision() <= put {
		t.Fatalf("after the retry the key holds %s (rev %d), want job %d recorded", en.Value(), en.Revision(), own.Seq)
	}

	// Another crashed reservation, now taken over by a stranger once old.
	if err := kv.Purge(ctx, name); err != nil {
		t.Fatal(err)
	}
	res, _ = json.Marshal(map[string]any{"id": "crashed-2", "partition": 1})
	if _, err := kv.Create(ctx, name, res, jetstream.KeyTTL(time.Hour)); err != nil {
		t.Fatal(err)
	}
	var taken worker.Enqueued
	for {
		taken, err = p.EnqueueTo(ctx, 0, []byte("x"), worker.UniqueKey("nightly", time.Hour))
		if err == nil {
			break
		}
		if dup := asDuplicate(t, err); dup.Existing.ID != "crashed-2" {
			t.Fatalf("refused for %+v", dup.Existing)
		}
		select {
		case <-ctx.Done():
			t.Fatal("the old reservation was never taken over")
		case <-time.After(200 * time.Millisecond): // the bound is a time: wait it out
		}
	}
	if taken.Seq == 0 || taken.ID == "crashed-2" {
		t.Fatalf("took over as %+v", taken)
	}

	// A value no producer wrote still holds the key, and says so.
	if err := kv.Purge(ctx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Create(ctx, name, []byte(`{"id":"x","partition":1,"evil":true}`), jetstream.KeyTTL(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if _, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.UniqueKey("nightly", time.Hour)); !errors.Is(err, worker.ErrDuplicateJob) {
		t.Fatalf("a forged value: %v", err)
	}
}

// Producers on the three nodes of a cluster racing for one uniqueness
// store one job between them (R3 answers a lost compare-and-set with
// other error codes than one node does), and all the others are refused
// with that job's reference.
func TestUniqueRaceOnACluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	c := natstest.StartCluster(t)
	ctx := ctxFor(t, time.Minute)
	if err := worker.ProvisionJobs(ctx, c.JetStream(t), worker.JobsConfig{Prefix: "jobs", Partitions: 4, Replicas: 3}); err != nil {
		t.Fatal(err)
	}
	const racers = 9
	type result struct {
		e   worker.Enqueued
		err error
	}
	results := make(chan result, racers)
	var ready sync.WaitGroup
	ready.Add(racers)
	gate := make(chan struct{})
	for i := range racers {
		p, err := worker.NewProducer(c.Node(i%3).JetStream(t), worker.ProducerConfig{Prefix: "jobs", Partitions: 4})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			ready.Done()
			<-gate
			e, err := worker.Enqueue(ctx, p, "report", emailArgs{To: "ops"}, worker.Unique(time.Hour))
			results <- result{e, err}
		}()
	}
	ready.Wait()
	close(gate)
	var stored []worker.Enqueued
	var refused []*worker.DuplicateJobError
	for range racers {
		r := <-results
		switch {
		case r.err == nil:
			stored = append(stored, r.e)
		default:
			refused = append(refused, asDuplicate(t, r.err))
		}
	}
	if len(stored) != 1 {
		t.Fatalf("%d racers stored the job: %+v", len(stored), stored)
	}
	for _, d := range refused {
		if d.Existing.ID != stored[0].ID || d.Existing.Seq != 0 && d.Existing.Seq != stored[0].Seq {
			t.Fatalf("a refusal names %+v, the job stored is %+v", d.Existing, stored[0])
		}
	}
}
