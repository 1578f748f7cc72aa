package worker_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Keys pick partitions the way Kafka's partitioner does; EnqueueTo names
// the partition, and a partition that does not exist is refused.
func TestEnqueuePicksPartitions(t *testing.T) {
	e := newEnv(t, 8)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	for i := range 50 {
		key := []byte(fmt.Sprintf("customer-%d", i))
		q, err := p.Enqueue(ctx, key, []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		if want := leasehold.PartitionFor(key, 8); q.Partition != want {
			t.Fatalf("key %s went to partition %d, want %d", key, q.Partition, want)
		}
	}
	q, err := p.EnqueueTo(ctx, 5, []byte("x"))
	if err != nil || q.Partition != 5 {
		t.Fatalf("EnqueueTo(5) = %+v, %v", q, err)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.GetMsg(ctx, q.Seq)
	if err != nil || m.Subject != worker.JobSubject(e.prefix, 5) {
		t.Fatalf("job %d stored on %v (%v)", q.Seq, m, err)
	}
	if _, err := p.EnqueueTo(ctx, 8, []byte("x")); err == nil || !strings.Contains(err.Error(), "0 to 7") {
		t.Fatalf("EnqueueTo(8) on 8 partitions: %v", err)
	}
}

// A job ID makes an enqueue idempotent: the stream stores it once within
// its duplicate window. Without one, each enqueue gets a fresh ID.
func TestJobIDDeduplicates(t *testing.T) {
	e := newEnv(t, 2)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	a, err := p.Enqueue(ctx, []byte("k"), []byte("x"), worker.JobID("order-17"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Enqueue(ctx, []byte("k"), []byte("x"), worker.JobID("order-17"))
	if err != nil {
		t.Fatal(err)
	}
	if a.Duplicate || !b.Duplicate || a.Seq != b.Seq || b.ID != "order-17" {
		t.Fatalf("first %+v, second %+v: want the second to be a duplicate of the first", a, b)
	}
	c, _ := p.Enqueue(ctx, []byte("k"), []byte("x"))
	d, _ := p.Enqueue(ctx, []byte("k"), []byte("x"))
	if c.ID == d.ID || c.Duplicate || d.Duplicate {
		t.Fatalf("two enqueues without an ID: %+v and %+v", c, d)
	}
	if _, err := p.Enqueue(ctx, []byte("k"), []byte("x"), worker.JobID("has space")); err == nil {
		t.Fatal("a job ID with a space was accepted")
	}
}

// A batch sends without waiting and reports where every job went, in
// order; sending the same IDs again stores nothing new.
func TestBatchEnqueue(t *testing.T) {
	e := newEnv(t, 4)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	send := func() []worker.Enqueued {
		b := p.Batch()
		for i := range 300 {
			if err := b.Enqueue(ctx, []byte(fmt.Sprint(i)), []byte("x"), worker.JobID(fmt.Sprintf("job-%d", i))); err != nil {
				t.Fatal(err)
			}
		}
		res, err := b.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if b.Len() != 0 || len(res) != 300 {
			t.Fatalf("%d results, %d left in the batch", len(res), b.Len())
		}
		return res
	}
	first, again := send(), send()
	for i := range first {
		if first[i].ID != fmt.Sprintf("job-%d", i) || first[i].Duplicate {
			t.Fatalf("result %d: %+v", i, first[i])
		}
		if !again[i].Duplicate || again[i].Seq != first[i].Seq {
			t.Fatalf("resent job %d: %+v, first %+v", i, again[i], first[i])
		}
	}
}

// A producer configured with another partition count than the stream's,
// or for a stream that does not exist, is refused on its first enqueue.
func TestProducerChecksTheStream(t *testing.T) {
	e := newEnv(t, 4)
	ctx := ctxFor(t, 30*time.Second)
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: 8})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Enqueue(ctx, []byte("k"), nil); !errors.Is(err, worker.ErrStreamConfig) || !strings.Contains(err.Error(), "has 4 partitions") {
		t.Fatalf("enqueue with 8 partitions on a 4-partition stream: %v", err)
	}
	p, _ = worker.NewProducer(e.js, worker.ProducerConfig{Prefix: "nope", Partitions: 4})
	if _, err := p.Enqueue(ctx, []byte("k"), nil); err == nil || !strings.Contains(err.Error(), "ProvisionJobs") {
		t.Fatalf("enqueue on a missing stream: %v", err)
	}
	if _, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: "a b"}); err == nil ||
		!strings.Contains(err.Error(), "prefix") || !strings.Contains(err.Error(), "partitions 0") {
		t.Fatalf("NewProducer with a bad config: %v", err)
	}
}
