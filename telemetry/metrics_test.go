package telemetry_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A worker and a sink record into one meter provider, and /metrics shows
// what they did under Prometheus names: leasehold_ prefix, base units,
// _total on counters.
func TestMetricsScrape(t *testing.T) {
	mp, metrics, err := telemetry.NewPrometheus()
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Shutdown(context.Background())
	tc := telemetry.Config{MeterProvider: mp, PartitionLabels: true}
	url := serve(t, metrics) + "/metrics"

	ctx := ctxFor(t, 2*time.Minute)
	js := natstest.Start(t).JetStream(t)
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "m-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "m", Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	mem := sink.NewMemory(sink.MemoryConfig{Logger: quiet(), Telemetry: tc})
	ev := newEvents()
	w := startWorker(t, worker.Config{
		JetStream: js, Bucket: bucket, Prefix: "m", Partitions: 2,
		Coordinator: coordinator.Config{Worker: "w1"},
		Fences:      []worker.Fence{mem},
		Backoff:     func(int) time.Duration { return time.Millisecond },
		Observer:    ev, Logger: quiet(), Telemetry: tc,
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			switch string(j.Data) {
			case "poison":
				return worker.Permanent(errors.New("cannot be handled"))
			case "flaky":
				if j.Attempt == 1 {
					return errors.New("try again")
				}
			}
			if err := j.Emit(ctx, j.Data); err != nil {
				return err
			}
			return j.Apply(ctx, mem, string(j.Data), j.Data)
		}),
	})
	prod, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "m", Partitions: 2})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		data := fmt.Sprintf("job-%d", i)
		switch i {
		case 5:
			data = "poison"
		case 7:
			data = "flaky"
		}
		if _, err := prod.EnqueueTo(ctx, 0, []byte(data)); err != nil {
			t.Fatal(err)
		}
	}

	// 18 jobs succeed at once, the flaky one at its second attempt, the
	// poison one is dead-lettered: 21 attempts, 2 of them failed.
	want := []string{
		"leasehold_jobs_processed_total 19",
		"leasehold_jobs_failed_total 2",
		"leasehold_jobs_dead_lettered_total 1",
		"leasehold_handler_duration_seconds_count 21",
		"leasehold_effects_emitted_total 38",
		`leasehold_sink_effects_total{leasehold_outcome="accepted",leasehold_sink="memory"} 19`,
		`leasehold_sink_effects_total{leasehold_outcome="advanced",leasehold_sink="memory"} 2`,
		"leasehold_leases_held 2",
		"leasehold_lease_acquisitions_total 2",
		`leasehold_consumer_lag{leasehold_partition="0",leasehold_worker="w1",messaging_client_id="w1",messaging_destination_partition_id="0"} 0`,
		"# TYPE leasehold_jobs_processed_total counter",
		"# TYPE leasehold_handler_duration_seconds histogram",
		"# TYPE leasehold_lease_renew_duration_seconds histogram",
		"# TYPE leasehold_leases_held gauge",
		"# TYPE leasehold_partition_epoch gauge",
	}
	var body string
	deadline := time.Now().Add(time.Minute)
	for {
		body = scrape(t, url)
		missing := missingLines(body, want)
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics lacks %q:\n%s", missing, grep(body, "leasehold_"))
		}
		select {
		case <-ev.ch: // the worker moved on
		case <-time.After(100 * time.Millisecond):
		}
	}
	if testing.Verbose() {
		t.Logf("/metrics:\n%s", grep(body, "leasehold_"))
	}
	held := w.w.Held()
	if len(held) != 2 {
		t.Fatalf("the worker holds %v", held)
	}
	for _, l := range held {
		// Prometheus values are float64, exact for epochs below 2^53.
		series := fmt.Sprintf(`leasehold_partition_epoch{leasehold_partition="%d",leasehold_worker="w1",messaging_client_id="w1",messaging_destination_partition_id="%d"} `, l.Partition, l.Partition)
		v, ok := value(body, series)
		if !ok || v != float64(l.Epoch) {
			t.Errorf("%s is %v, want %d:\n%s", series, v, l.Epoch, grep(body, "leasehold_partition_epoch"))
		}
	}
	// Every leasehold metric is named in base units or counts, never
	// milliseconds.
	if regexp.MustCompile(`leasehold_\w*_(milliseconds|ms)\b`).MatchString(body) {
		t.Errorf("a metric is not in base units:\n%s", grep(body, "leasehold_"))
	}

	// After a graceful stop, nothing is held and no epoch is reported.
	w.stop(t)
	body = scrape(t, url)
	if !strings.Contains(body, "leasehold_leases_held 0") || strings.Contains(body, "leasehold_partition_epoch{") {
		t.Errorf("after the stop:\n%s", grep(body, "leasehold_lease"))
	}
}
