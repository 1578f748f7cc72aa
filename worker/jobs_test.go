package worker_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// ProvisionJobs creates the job, dead-letter and output streams as
// limit-based, file-backed logs with a duplicate window and the partition
// count in their metadata, and accepts them when run again.
func TestProvisionJobs(t *testing.T) {
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	cfg := worker.JobsConfig{Prefix: "orders", Partitions: 12}
	for range 2 {
		if err := worker.ProvisionJobs(ctx, js, cfg); err != nil {
			t.Fatal(err)
		}
	}
	for name, subject := range map[string]string{
		worker.JobsStream("orders"):    "orders.jobs.*",
		worker.DLQStream("orders"):     "orders.dlq.>",
		worker.EffectsStream("orders"): "orders.out.>",
	} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		c := s.CachedInfo().Config
		if len(c.Subjects) != 1 || c.Subjects[0] != subject || c.Retention != jetstream.LimitsPolicy ||
			c.Storage != jetstream.FileStorage || c.Duplicates != 2*time.Minute || c.Metadata["leasehold.partitions"] != "12" {
			t.Errorf("stream %s: %+v", name, c)
		}
	}
}

// Beyond 1000 partitions the job stream must say how many consumers it
// takes: the server caps a stream that says "unlimited" at 1000.
func TestProvisionJobsAllowsAConsumerPerPartition(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, time.Minute)
	const partitions = 1001 // one more consumer than the server's default cap
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "wide", Partitions: partitions, NoEffects: true}); err != nil {
		t.Fatal(err)
	}
	for p := range partitions + 1 {
		_, err := js.CreateConsumer(ctx, worker.JobsStream("wide"), jetstream.ConsumerConfig{
			FilterSubject: worker.JobSubject("wide", leasehold.Partition(p%partitions)), AckPolicy: jetstream.AckNonePolicy,
			InactiveThreshold: time.Minute,
		})
		if err != nil {
			t.Fatalf("consumer %d: %v", p, err)
		}
	}
}

// A stream that exists with settings leasehold cannot work with is refused
// with an error that says what differs.
func TestProvisionJobsRefusesMismatches(t *testing.T) {
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "orders", Partitions: 12}); err != nil {
		t.Fatal(err)
	}
	err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "orders", Partitions: 16})
	if !errors.Is(err, worker.ErrStreamConfig) || !strings.Contains(err.Error(), "provisioned for 12 partitions and 16 were asked for") {
		t.Fatalf("another partition count: %v", err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "mem-jobs", Subjects: []string{"mem.jobs.*"}, Storage: jetstream.MemoryStorage, Retention: jetstream.WorkQueuePolicy}); err != nil {
		t.Fatal(err)
	}
	err = worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "mem", Partitions: 2})
	for _, want := range []string{"storage is memory", "retention", "not created by leasehold"} {
		if !errors.Is(err, worker.ErrStreamConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("a memory work-queue stream: %v does not say %q", err, want)
		}
	}
	err = worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "a.b", Partitions: 0, Replicas: 7})
	for _, want := range []string{"prefix \"a.b\"", "partitions 0", "replicas 7"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("a bad config: %v does not say %q", err, want)
		}
	}
}
