package worker_test

import (
	"context"
	"fmt"
	"runtime/pprof"
	"sync/atomic"
	"testing"

	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

// BenchmarkTelemetry runs BenchmarkEndToEnd's leasehold pipeline three
// ways, in turn (in a rotating order) in every iteration, on one server:
//
//   - off: no-op tracer and meter providers, what the OpenTelemetry
//     globals are until something installs providers;
//   - metrics: the metrics recorded into a Prometheus reader, no tracing;
//   - traced: the metrics, and every trace sampled, every span sent
//     through a batch span processor to an exporter that drops it, with
//     W3C trace context in every job and effect;
//   - sampled: traced, with one trace in ten sampled where the producer
//     starts it (parent-based below), a common production setting.
//
// It reports each mode's median jobs/s and CPU time per job (of the whole
// process, the embedded server included), the medians of the per-iteration
// ratios of rates traced/metrics (the cost of tracing every job),
// sampled/metrics and metrics/off (the cost of metrics), the same ratios
// of CPU time per job, and the spans exported per traced job. On a busy machine the rates scatter; the CPU
// times much less.
//
//	go test -run '^$' -bench 'Telemetry' -benchtime 5x -count 3 ./worker/
func BenchmarkTelemetry(b *testing.B) { benchTelemetry(b, false) }

// BenchmarkTelemetryBacklog is BenchmarkTelemetry with the jobs enqueued
// before the clock starts (see BenchmarkBacklog): it weighs the workers'
// telemetry alone.
func BenchmarkTelemetryBacklog(b *testing.B) { benchTelemetry(b, true) }

type telemetryMode int

const (
	modeOff telemetryMode = iota
	modeMetrics
	modeTraced
	modeSampled
	modes
)

func (m telemetryMode) String() string { return [...]string{"off", "metrics", "traced", "sampled"}[m] }

func benchTelemetry(b *testing.B, backlog bool) {
	srv := natstest.Start(b, natstest.Listen())
	payload := make([]byte, benchPayload)
	var rates, cpus [modes][]float64
	var tracing, metrics, sampled, tracingCPU, metricsCPU, sampledCPU []float64
	var spans atomic.Int64
	b.StopTimer()
	run := func(i int, mode telemetryMode) pace {
		prefix := fmt.Sprintf("t%d-%d", mode, i)
		tc := telemetry.Config{TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: noop.NewMeterProvider(), Propagator: propagation.TraceContext{}}
		if mode >= modeMetrics {
			mp, _, err := telemetry.NewPrometheus()
			if err != nil {
				b.Fatal(err)
			}
			defer mp.Shutdown(context.Background())
			tc.MeterProvider = mp
		}
		sampler := sdktrace.AlwaysSample()
		if mode == modeSampled {
			sampler = sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.1))
		}
		if mode >= modeTraced {
			counted := discard{&spans}
			if mode == modeSampled {
				counted = discard{new(atomic.Int64)}
			}
			tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sampler), sdktrace.WithBatcher(counted))
			defer tp.Shutdown(context.Background())
			tc.TracerProvider = tp
		}
		return leaseholdPipeline(b, srv, prefix, payload, backlog, tc)
	}
	for i := range b.N {
		// Each iteration measures every mode back to back, starting with
		// another one each time, so that the machine's drift weighs on all
		// alike; the ratios are taken per iteration.
		var r [modes]pace
		for k := range modes {
			m := (telemetryMode(i) + k) % modes
			// The label lets a CPU profile of the benchmark tell the modes
			// apart (go tool pprof -tagfocus telemetry=traced).
			pprof.Do(context.Background(), pprof.Labels("telemetry", m.String()), func(context.Context) { r[m] = run(i, m) })
			rates[m] = append(rates[m], r[m].rate)
			cpus[m] = append(cpus[m], float64(r[m].cpuPerJob.Microseconds()))
		}
		tracing = append(tracing, r[modeTraced].rate/r[modeMetrics].rate)
		metrics = append(metrics, r[modeMetrics].rate/r[modeOff].rate)
		sampled = append(sampled, r[modeSampled].rate/r[modeMetrics].rate)
		tracingCPU = append(tracingCPU, float64(r[modeTraced].cpuPerJob)/float64(r[modeMetrics].cpuPerJob))
		metricsCPU = append(metricsCPU, float64(r[modeMetrics].cpuPerJob)/float64(r[modeOff].cpuPerJob))
		sampledCPU = append(sampledCPU, float64(r[modeSampled].cpuPerJob)/float64(r[modeMetrics].cpuPerJob))
	}
	b.ReportMetric(median(rates[modeOff]), "off_jobs/s")
	b.ReportMetric(median(rates[modeMetrics]), "metrics_jobs/s")
	b.ReportMetric(median(rates[modeTraced]), "traced_jobs/s")
	b.ReportMetric(median(rates[modeSampled]), "sampled_jobs/s")
	b.ReportMetric(median(tracing), "traced/metrics")
	b.ReportMetric(median(sampled), "sampled/metrics")
	b.ReportMetric(median(metrics), "metrics/off")
	b.ReportMetric(median(cpus[modeOff]), "off_cpu_us/job")
	b.ReportMetric(median(cpus[modeMetrics]), "metrics_cpu_us/job")
	b.ReportMetric(median(cpus[modeTraced]), "traced_cpu_us/job")
	b.ReportMetric(median(cpus[modeSampled]), "sampled_cpu_us/job")
	b.ReportMetric(median(tracingCPU), "cpu_traced/metrics")
	b.ReportMetric(median(sampledCPU), "cpu_sampled/metrics")
	b.ReportMetric(median(metricsCPU), "cpu_metrics/off")
	b.ReportMetric(float64(spans.Load())/float64(b.N*benchJobs), "spans/job")
	b.ReportMetric(0, "ns/op")
}

// discard is a span exporter that counts spans and drops them.
type discard struct{ n *atomic.Int64 }

func (d discard) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	d.n.Add(int64(len(spans)))
	return nil
}

func (discard) Shutdown(context.Context) error { return nil }
