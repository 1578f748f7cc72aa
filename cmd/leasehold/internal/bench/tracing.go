package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime/pprof"
	"sync/atomic"
	"syscall"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/leasehold/leasehold/telemetry"
)

// A tracing setting is how the pipeline's processes would be configured:
// telemetry.Setup with an OTLP endpoint and a sampler, or without an
// endpoint (metrics only), which is the baseline.
type tracing int

const (
	tracingOff     tracing = iota // Setup without an endpoint: metrics, no spans
	tracingDefault                // Setup's default sampler
	tracingAlways                 // every trace sampled
)

func (t tracing) String() string { return [...]string{"off", "default", "always"}[t] }

// otlpSink is an OTLP/HTTP receiver that reads each export and drops it,
// standing in for a collector: the pipeline pays for building, batching,
// encoding and posting every span, and nothing for storing them.
type otlpSink struct {
	srv   *http.Server
	ln    net.Listener
	posts atomic.Int64
	bytes atomic.Int64
	spans atomic.Int64 // in uncompressed exports
}

// countSpans counts the spans of an OTLP ExportTraceServiceRequest:
// resource_spans (1), their scope_spans (2), their spans (2). It walks the
// wire format without decoding the spans, and stops at anything malformed.
func countSpans(b []byte) int {
	n := 0
	each(b, 1, func(rs []byte) {
		each(rs, 2, func(ss []byte) {
			each(ss, 2, func([]byte) { n++ })
		})
	})
	return n
}

// each calls f with every length-delimited field number num of message b.
func each(b []byte, num protowire.Number, f func([]byte)) {
	for len(b) > 0 {
		n, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return
		}
		b = b[l:]
		if n == num && typ == protowire.BytesType {
			v, l := protowire.ConsumeBytes(b)
			if l < 0 {
				return
			}
			f(v)
			b = b[l:]
			continue
		}
		if l = protowire.ConsumeFieldValue(n, typ, b); l < 0 {
			return
		}
		b = b[l:]
	}
}

func startOTLPSink() (*otlpSink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("OTLP receiver: %w", err)
	}
	o := &otlpSink{ln: ln}
	o.srv = &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		o.posts.Add(1)
		o.bytes.Add(int64(len(body)))
		if err == nil && r.Header.Get("Content-Encoding") == "" {
			o.spans.Add(int64(countSpans(body)))
		}
		// An empty ExportTraceServiceResponse: everything accepted.
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	})}
	go func() { _ = o.srv.Serve(ln) }()
	return o, nil
}

func (o *otlpSink) endpoint() string { return "http://" + o.ln.Addr().String() }

func (o *otlpSink) close() { _ = o.srv.Close() }

// cpuTime is the CPU time this process has used, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// setupTracing builds the telemetry of one pipeline run with setting t,
// the way `leasehold worker` and `leasehold sink` build theirs.
func (e *env) setupTracing(ctx context.Context, t tracing, o *otlpSink) (*telemetry.Telemetry, func(), error) {
	cfg := telemetry.SetupConfig{ServiceName: "leasehold-bench", NoGlobals: true}
	switch t {
	case tracingDefault:
		cfg.OTLPEndpoint = o.endpoint()
	case tracingAlways:
		cfg.OTLPEndpoint = o.endpoint()
		cfg.Sampler = sdktrace.AlwaysSample()
	}
	tel, _, shutdown, err := telemetry.Setup(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	return tel, func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			e.log.Warn("bench: telemetry shutdown", "err", err)
		}
	}, nil
}

// tracingCost measures leasehold's end-to-end throughput with tracing at
// Setup's default sampler and with every trace sampled, each beside the
// same pipeline with metrics and no spans, all three interleaved.
func (e *env) tracingCost(ctx context.Context) ([]Row, error) {
	o, err := startOTLPSink()
	if err != nil {
		return nil, err
	}
	defer o.close()
	n := e.pipeJobs()
	settings := []tracing{tracingOff, tracingDefault, tracingAlways}
	got, cpus := map[tracing][]float64{}, map[tracing][]float64{}
	spans := map[tracing][]float64{}            // exported per job
	var floors, floorCPUs, floorSpans []float64 // floorCPUs: off's CPU per job plus the floor's
	for i := range e.cfg.Runs {
		for j := range settings {
			t := settings[(i+j)%len(settings)] // rotate the order
			var r, cpu float64
			// The label tells the settings apart in a CPU profile (go
			// tool pprof -tagfocus tracing=always) for the goroutines
			// the run starts: the pipeline's and the exporter's, not
			// the server's.
			pprof.Do(ctx, pprof.Labels("tracing", t.String()), func(ctx context.Context) {
				var tel *telemetry.Telemetry
				var stop func()
				if tel, stop, err = e.setupTracing(ctx, t, o); err != nil {
					return
				}
				cpu0, spans0 := cpuTime(), o.spans.Load()
				r, err = e.throughputWith(ctx, false, fmt.Sprintf("tr-%v%d", t, i), n, tel.Config())
				cpu = (cpuTime() - cpu0).Seconds() * 1e6 / float64(n)
				stop() // exports what is queued
				spans[t] = append(spans[t], float64(o.spans.Load()-spans0)/float64(n))
			})
			if err != nil {
				return nil, err
			}
			got[t] = append(got[t], r)
			cpus[t] = append(cpus[t], cpu)
		}
		spans0 := o.spans.Load()
		var floor float64
		pprof.Do(ctx, pprof.Labels("tracing", "floor"), func(ctx context.Context) {
			floor, err = e.spanFloor(ctx, o, n)
		})
		if err != nil {
			return nil, err
		}
		floors, floorCPUs = append(floors, floor), append(floorCPUs, cpus[tracingOff][i]+floor)
		floorSpans = append(floorSpans, float64(o.spans.Load()-spans0)/float64(n))
		e.progress("tracing run %d: off %.0f jobs/s %.0f µs CPU/job, default %.0f jobs/s %.0f µs (%.2f spans a job exported), always %.0f jobs/s %.0f µs (%.2f spans); the SDK and exporter alone %.1f µs a job (%.2f spans)", i+1,
			got[tracingOff][i], cpus[tracingOff][i], got[tracingDefault][i], cpus[tracingDefault][i], spans[tracingDefault][i],
			got[tracingAlways][i], cpus[tracingAlways][i], spans[tracingAlways][i], floor, floorSpans[i])
	}
	e.progress("tracing: %d exports, %.1f MiB, %d spans received", o.posts.Load(), float64(o.bytes.Load())/(1<<20), o.spans.Load())
	what := fmt.Sprintf("leasehold end to end (%d jobs, as e2e_throughput) with telemetry.Setup exporting over OTLP/HTTP to a receiver that drops the spans", n)
	base := "; baseline: the same with Setup and no endpoint (metrics, no spans)"
	cpuNote := "CPU time of this process (server, producer, workers, sink runner, exporter) per job in the tracing rows' runs; baseline: tracing off. On a shared machine this holds better than throughput"
	return []Row{
		paired("tracing_default", "jobs/s", got[tracingDefault], got[tracingOff], what+", Setup's default sampler (parent-based, 1 in 10 new traces, every refused write)"+base+"; target ratio >= 0.9"),
		paired("tracing_always", "jobs/s", got[tracingAlways], got[tracingOff], what+", every trace sampled"+base+"; target ratio >= 0.8"),
		paired("tracing_default_cpu", "µs CPU/job", cpus[tracingDefault], cpus[tracingOff], cpuNote),
		paired("tracing_always_cpu", "µs CPU/job", cpus[tracingAlways], cpus[tracingOff], cpuNote),
		// The ratio is comparable with tracing_always_cpu's: the least
		// it can be with the stock SDK and exporter once no span is
		// dropped.
		withValue(paired("tracing_always_floor_cpu", "µs CPU/job", floorCPUs, cpus[tracingOff],
			"CPU time per job of the OpenTelemetry SDK and OTLP/HTTP exporter alone (no NATS, no leasehold) recording and exporting the four spans a job makes with every trace sampled "+
				"(enqueue send, process, effect send, sink process, with leasehold's attributes and W3C context through NATS headers), to the same receiver, none dropped; "+
				"baseline: CPU per job with tracing off; the ratio is (off + floor) / off, the least tracing_always_cpu's ratio can be when every span is exported"), median(floors)),
		single("tracing_always_spans", "spans/job", spans[tracingAlways], "spans the receiver got per job with every trace sampled: 4 when none was dropped "+
			"(a batch span processor drops spans that do not fit its queue rather than slow the jobs down)"),
		single("tracing_always_floor_spans", "spans/job", floorSpans, "spans the receiver got per job of tracing_always_floor_cpu: 4"),
	}, nil
}

// withValue is r with its value replaced: a row whose ratio compares
// something other than the value with the baseline.
func withValue(r Row, v float64) Row {
	r.Value = v
	return r
}
