package telemetry_test

import (
	"context"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/telemetry"
)

// The metrics of held partitions are one series per process unless
// PartitionLabels asks for one per partition and worker: with thousands
// of partitions and pod-named workers, per-partition labels are the
// cardinality Prometheus' naming guide warns of. Opted in, each series
// names its partition and worker in leasehold's labels and in
// OpenTelemetry's messaging ones.
func TestPartitionLabelsAreOptIn(t *testing.T) {
	t.Parallel()
	record := func(labels bool) string {
		mp, metrics, err := telemetry.NewPrometheus()
		if err != nil {
			t.Fatal(err)
		}
		defer mp.Shutdown(context.Background())
		m := telemetry.New(telemetry.Config{MeterProvider: mp, PartitionLabels: labels}).Metrics
		m.SetEpoch("pod-a", 0, 11)
		m.SetEpoch("pod-a", 1, 12)
		m.SetEpoch("pod-b", 2, 13)
		m.SetLag("pod-a", 0, 3)
		m.SetLag("pod-a", 1, 4)
		m.SetLag("pod-b", 2, 5)
		m.SetStalled("pod-b", 2, true)
		m.SetSubjectsUnavailable("pod-a", 2)
		m.JobsHung.Add(context.Background(), 1, m.PartitionAttrs("pod-a", 1))
		return scrape(t, serve(t, metrics)+"/metrics")
	}

	body := record(false)
	want := []string{
		"leasehold_consumer_lag 12",
		"leasehold_partition_stalled 1",
		"leasehold_effect_subjects_unavailable 2",
		"leasehold_jobs_hung_total 1",
	}
	if missing := missingLines(body, want); len(missing) > 0 {
		t.Errorf("by default, /metrics lacks %q:\n%s", missing, grep(body, "leasehold_"))
	}
	for _, label := range []string{"leasehold_partition=", "leasehold_worker=", "messaging_"} {
		if strings.Contains(body, label) {
			t.Errorf("by default a series carries %s:\n%s", label, grep(body, "leasehold_"))
		}
	}
	if strings.Contains(body, "leasehold_partition_epoch") {
		t.Errorf("by default the epochs are exported:\n%s", grep(body, "leasehold_partition_epoch"))
	}

	body = record(true)
	want = []string{
		`leasehold_consumer_lag{leasehold_partition="2",leasehold_worker="pod-b",messaging_client_id="pod-b",messaging_destination_partition_id="2"} 5`,
		`leasehold_partition_epoch{leasehold_partition="1",leasehold_worker="pod-a",messaging_client_id="pod-a",messaging_destination_partition_id="1"} 12`,
		`leasehold_partition_stalled{leasehold_partition="2",leasehold_worker="pod-b",messaging_client_id="pod-b",messaging_destination_partition_id="2"} 1`,
		`leasehold_jobs_hung_total{leasehold_partition="1",leasehold_worker="pod-a",messaging_client_id="pod-a",messaging_destination_partition_id="1"} 1`,
		`leasehold_effect_subjects_unavailable{leasehold_worker="pod-a",messaging_client_id="pod-a"} 2`,
	}
	if missing := missingLines(body, want); len(missing) > 0 {
		t.Errorf("with PartitionLabels, /metrics lacks %q:\n%s", missing, grep(body, "leasehold_"))
	}
}
