package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestBenchQuickJSON runs `leasehold bench --quick --json`, worker
// processes included (this test binary acts as the leasehold command when
// started as a child), and checks that the rows are well formed. It
// asserts no timings: the machine is shared and noisy.
func TestBenchQuickJSON(t *testing.T) {
	skipUnderRace(t)
	ctx := fleetTest(t, "starts worker processes and a NATS server", 10*time.Minute)
	// One run a figure: the test checks the rows, not their medians.
	out, err := run(t, ctx, "bench", "--quick", "--json", "--runs", "1")
	if err != nil {
		t.Fatalf("bench --quick --json: %v\n%s", err, out)
	}
	// Progress lines go to stderr, which run merges: the JSON array is
	// what starts at the first line that opens one.
	start := strings.Index(out, "\n[")
	if strings.HasPrefix(out, "[") {
		start = -1
	}
	var rows []map[string]any
	if err := json.Unmarshal([]byte(out[start+1:]), &rows); err != nil {
		t.Fatalf("output is not a JSON array of rows: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	for _, r := range rows {
		name, _ := r["name"].(string)
		unit, _ := r["unit"].(string)
		if name == "" || unit == "" || seen[name] {
			t.Errorf("row without a name or unit, or repeated: %v", r)
		}
		seen[name] = true
		for _, k := range []string{"value", "baseline", "ratio"} {
			if _, ok := r[k]; !ok {
				t.Errorf("row %s has no %q", name, k)
			}
		}
		if _, ok := r["value"].(float64); !ok {
			t.Errorf("row %s: value %v is not a number", name, r["value"])
		}
		if (r["baseline"] == nil) != (r["ratio"] == nil) {
			t.Errorf("row %s: a baseline without a ratio or the other way round: %v", name, r)
		}
	}
	for _, want := range []string{"e2e_throughput", "e2e_cpu", "e2e_latency_p50", "e2e_latency_p99", "tracing_default", "tracing_always",
		"fence_memory", "fence_kv", "fence_kv_batch", "fence_kv_batch_vs_idempotent", "kv_atomic_floor", "fence_postgres",
		"failover_crash_p99", "handoff_graceful_p99", "scaleout_balanced", "scaleout_rejected_writes", "scale_owned", "scale_renew_load", "scale_workers_balanced"} {
		if !seen[want] {
			t.Errorf("no row %s in:\n%s", want, out)
		}
	}
	for _, r := range rows {
		if r["name"] == "e2e_throughput" {
			if v, _ := r["value"].(float64); v <= 0 || r["baseline"] == nil {
				t.Errorf("e2e_throughput has no measurement beside its baseline: %v", r)
			}
		}
	}
}

// TestBenchClusterSync runs the pipeline, tracing and fence rows on a
// 3-node cluster with every write synced, and checks that each comes with
// its baseline and that the table names the configuration.
func TestBenchClusterSync(t *testing.T) {
	skipUnderRace(t)
	ctx := fleetTest(t, "starts a 3-node NATS cluster", 10*time.Minute)
	out, err := run(t, ctx, "bench", "--quick", "--runs", "1", "--cluster", "--sync", "--only", "e2e,tracing,fence")
	if err != nil {
		t.Fatalf("bench --cluster --sync: %v\n%s", err, out)
	}
	if !strings.Contains(out, "servers: 3-node cluster, R3, sync_interval always") {
		t.Errorf("the table does not name the configuration:\n%s", out)
	}
	for _, name := range []string{"e2e_throughput", "tracing_default", "fence_kv_batch"} {
		found := false
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			if len(f) == 6 && f[0] == name && f[3] != "-" && f[4] != "-" {
				found = true
			}
		}
		if !found {
			t.Errorf("no row %s with a baseline and a ratio in:\n%s", name, out)
		}
	}
}

func TestBenchRejectsUnknownScenario(t *testing.T) {
	t.Parallel()
	out, err := run(t, context.Background(), "bench", "--only", "e2e,nonsense")
	if err == nil || !strings.Contains(err.Error(), `scenario "nonsense"`) {
		t.Fatalf("bench --only nonsense: %v\n%s", err, out)
	}
}

// skipUnderRace skips a test that runs benchmarks from end to end: under
// the race detector they take minutes of a slow machine's time and test
// the bench command, not concurrent code of its own (the code they run is
// raced by its own packages' tests). CI runs them without the detector.
func skipUnderRace(t *testing.T) {
	t.Helper()
	if raceDetector {
		t.Skip("a whole bench run; slow under the race detector, so CI runs it without: go test -run 'TestBench' ./cmd/leasehold")
	}
}
