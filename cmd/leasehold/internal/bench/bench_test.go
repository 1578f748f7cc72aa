package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testleak"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// The benchmarks' server configuration, as bench's --cluster and --sync
// set it: go test ./internal/bench -run '^$' -bench ScaleMax -benchtime 1x
// -args -cluster -sync.
var (
	benchCluster = flag.Bool("cluster", false, "benchmarks: a 3-node cluster, every stream and bucket at 3 replicas")
	benchSync    = flag.Bool("sync", false, "benchmarks: servers with sync_interval: always")
)

func TestMedianAndPercentile(t *testing.T) {
	t.Parallel()
	if got := median([]float64{3, 1, 2}); got != 2 {
		t.Errorf("median odd = %v", got)
	}
	if got := median([]float64{4, 1, 3, 2}); got != 2.5 {
		t.Errorf("median even = %v", got)
	}
	if got := median(nil); got != 0 {
		t.Errorf("median empty = %v", got)
	}
	xs := make([]float64, 100)
	for i := range xs {
		xs[i] = float64(100 - i)
	}
	if got := percentile(xs, 0.99); got != 99 {
		t.Errorf("p99 = %v", got)
	}
	if got := percentile(xs, 0.5); got != 50 {
		t.Errorf("p50 = %v", got)
	}
	if got := percentile([]float64{7}, 0.99); got != 7 {
		t.Errorf("p99 of one = %v", got)
	}
}

func TestPairedTakesTheMedianOfPerRunRatios(t *testing.T) {
	t.Parallel()
	// Drift moves both sides together; the per-run ratios stay at 0.5.
	r := paired("x", "ops/s", []float64{10, 50, 100}, []float64{20, 100, 200}, "")
	if r.Value != 50 || *r.Baseline != 100 || *r.Ratio != 0.5 || r.Runs != 3 {
		t.Errorf("paired = %+v (baseline %v, ratio %v)", r, *r.Baseline, *r.Ratio)
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	err := Config{Runs: -1, Scenarios: []string{"e2e", "nope"}}.Validate()
	if err == nil || !strings.Contains(err.Error(), "runs -1") || !strings.Contains(err.Error(), `scenario "nope"`) {
		t.Fatalf("Validate = %v", err)
	}
	if _, err := Run(context.Background(), Config{Scenarios: []string{"nope"}}); err == nil {
		t.Fatal("Run accepted an unknown scenario")
	}
}

func TestConfiguration(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "1 server, R1, default sync (2 min)"},
		{Config{Cluster: true}, "3-node cluster, R3, default sync (2 min)"},
		{Config{Sync: true}, "1 server, R1, sync_interval always"},
		{Config{Cluster: true, Sync: true}, "3-node cluster, R3, sync_interval always"},
	} {
		if got := c.cfg.Configuration(); got != c.want {
			t.Errorf("%+v: %q, want %q", c.cfg, got, c.want)
		}
	}
}

func TestWriters(t *testing.T) {
	t.Parallel()
	b, r := 2.0, 0.5
	rows := []Row{
		{Name: "a", Value: 1, Unit: "s", Baseline: &b, Ratio: &r, Runs: 3, Note: "about a"},
		{Name: "skipped", Unit: "µs/effect", Note: "skipped: why"},
	}
	var out bytes.Buffer
	if err := WriteTable(&out, rows); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"NAME", "0.500", "skipped: why", "a: about a"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	out.Reset()
	if err := WriteJSON(&out, rows); err != nil {
		t.Fatal(err)
	}
	var back []map[string]any
	if err := json.Unmarshal(out.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if back[0]["ratio"] != 0.5 || back[1]["baseline"] != nil {
		t.Errorf("JSON rows: %s", out.String())
	}
}

// TestInProcessScenarios runs the scenarios that need no worker processes,
// at the quick sizes, and checks the rows they produce.
func TestInProcessScenarios(t *testing.T) {
	t.Parallel()
	// The bound is for a stuck run: at load 25 the quick scenarios took
	// more than 5 minutes.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	rows, err := Run(ctx, Config{Quick: true, Runs: 1, Scenarios: []string{"e2e", "tracing", "fence"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]Row{}
	for _, r := range rows {
		names[r.Name] = r
	}
	for _, n := range []string{"e2e_throughput", "e2e_cpu", "e2e_throughput_all_or_none", "e2e_throughput_all_or_none_unpacked", "e2e_cpu_all_or_none", "tracing_default", "tracing_always", "tracing_default_cpu", "tracing_always_cpu", "tracing_always_floor_cpu",
		"fence_memory", "fence_kv", "fence_kv_batch", "fence_kv_batch_vs_idempotent", "kv_atomic_floor", "fence_postgres"} {
		if _, ok := names[n]; !ok {
			t.Errorf("no row %s in %+v", n, rows)
		}
	}
	for _, n := range []string{"e2e_throughput", "e2e_cpu_all_or_none"} {
		if r := names[n]; r.Value <= 0 || r.Baseline == nil || *r.Baseline <= 0 || r.Ratio == nil {
			t.Errorf("%s = %+v", n, r)
		}
	}
}

// On the cluster every stream and bucket a scenario creates, the leasehold
// pipeline's and the raw baseline's, has three replicas, and the nodes sync
// every write when asked to.
func TestClusterEnvReplicates(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := Config{Cluster: true, Sync: true, Runs: 1, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	cfg.setDefaults()
	e, err := startEnv(ctx, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.close()
	if len(e.srvs) != 3 || strings.Count(e.url, ",") != 2 {
		t.Fatalf("%d servers at %q, want 3", len(e.srvs), e.url)
	}
	for _, srv := range e.srvs {
		if !srv.JetStreamConfig().SyncAlways {
			t.Errorf("%s does not sync every write", srv.Name())
		}
	}
	nc, js, err := e.connect("test")
	if err != nil {
		t.Fatal(err)
	}
	defer e.release(nc)
	for _, raw := range []bool{false, true} {
		prefix := fmt.Sprintf("rep%v", raw)
		p, err := e.startPipeline(ctx, raw, prefix, newApplied(1, false))
		if err != nil {
			t.Fatal(err)
		}
		names := js.StreamNames(ctx)
		seen := 0
		for n := range names.Name() {
			if !strings.Contains(n, prefix) {
				continue
			}
			seen++
			s, err := js.Stream(ctx, n)
			if err != nil {
				t.Fatal(err)
			}
			if r := s.CachedInfo().Config.Replicas; r != 3 {
				t.Errorf("stream %s has %d replicas, want 3", n, r)
			}
		}
		if seen < 3 {
			t.Errorf("raw %v: only %d streams under %s", raw, seen, prefix)
		}
		p.stop()
	}
}

// BenchmarkEndToEnd runs the end-to-end scenario in this process, for
// profiling the path from enqueue to applied effect:
//
//	go test ./internal/bench -run '^$' -bench EndToEnd -benchtime 1x -cpuprofile cpu.out
func BenchmarkEndToEnd(b *testing.B) {
	for b.Loop() {
		rows, err := Run(context.Background(), Config{Runs: 3, Scenarios: []string{"e2e"}})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(rows[0].Value, "jobs/s")
		b.ReportMetric(*rows[0].Baseline, "raw_jobs/s")
		b.ReportMetric(*rows[0].Ratio, "ratio")
	}
}

// BenchmarkScale starts 32 lease-layer members on 4096 partitions in this
// process (on their own connections), for profiling the lease path at
// scale:
//
//	go test ./internal/bench -run '^$' -bench 'Scale$' -benchtime 1x -cpuprofile cpu.out
func BenchmarkScale(b *testing.B) {
	benchScale(b, 4096, 32)
}

// BenchmarkScaleMax is BenchmarkScale at the most partitions the API
// allows, over 64 members (the scale_max rows), here on a 3-node cluster
// with sync always:
//
//	go test ./internal/bench -run '^$' -bench ScaleMax -benchtime 1x -args -cluster -sync
func BenchmarkScaleMax(b *testing.B) {
	benchScale(b, 65536, 64)
}

func benchScale(b *testing.B, partitions, members int) {
	cfg := Config{Runs: 1, Cluster: *benchCluster, Sync: *benchSync}
	cfg.setDefaults()
	e, err := startEnv(context.Background(), &cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer e.close()
	run := 0
	for b.Loop() {
		r, err := e.scaleRun(context.Background(), "bs"+string(rune('a'+run)), partitions, members, 10*time.Second, 10*time.Second, asLeases, 2*time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		run++
		b.ReportMetric(r.joined, "joined_s")
		b.ReportMetric(r.owned, "owned_s")
		b.ReportMetric(r.balanced, "balanced_s")
		b.ReportMetric(r.opsPerSec, "kv_ops/s")
		b.ReportMetric(r.memMiB, "MiB/member")
	}
}
