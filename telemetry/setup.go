package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// SetupConfig configures Setup. Every field is optional.
type SetupConfig struct {
	// ServiceName is the service.name of every span and of the metrics'
	// target_info. Default: $OTEL_SERVICE_NAME, else "leasehold".
	ServiceName string
	// ResourceAttributes are added to the resource, after those of
	// $OTEL_RESOURCE_ATTRIBUTES; service.instance.id set to the worker ID
	// is a good one.
	ResourceAttributes []attribute.KeyValue
	// OTLPEndpoint is the base URL of an OTLP/HTTP receiver, such as
	// "http://127.0.0.1:4318" (Jaeger, an OpenTelemetry Collector); spans
	// are posted to <OTLPEndpoint>/v1/traces unless the URL already ends
	// in /v1/traces. https URLs use TLS. Default:
	// $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT,
	// read by the exporter as the OpenTelemetry specification says, with
	// the exporter's other OTEL_EXPORTER_OTLP_* settings (headers,
	// timeout, compression). With no endpoint at all, or with
	// OTEL_SDK_DISABLED=true, spans are not recorded: the tracer provider
	// is a no-op that still carries trace context from jobs to effects.
	OTLPEndpoint string
	// Sampler decides which traces are recorded. Default: $OTEL_TRACES_SAMPLER
	// (and $OTEL_TRACES_SAMPLER_ARG) when set, else DefaultSampler: every
	// trace a job's enqueuer sampled, and one in ten of the traces started
	// here. Setup wraps it with KeepRefusals, so that refused writes are
	// recorded whatever it decides. Sampling every trace
	// (sdktrace.AlwaysSample(), or OTEL_TRACES_SAMPLER=always_on) adds
	// about four times the CPU per job the default adds (about 30 µs
	// against 7 on one server); see docs/benchmarks.md.
	Sampler sdktrace.Sampler
	// NoGlobals keeps Setup from installing its providers and propagator as
	// the OpenTelemetry globals. By default it installs them, so that every
	// worker, producer and sink built with a zero telemetry.Config, and
	// other libraries' instrumentation, use them.
	NoGlobals bool
	// PartitionLabels is Config.PartitionLabels: a series per partition
	// and worker for the metrics of held partitions. Off by default.
	PartitionLabels bool
}

// Setup builds the telemetry of a leasehold process: a tracer provider
// exporting over OTLP/HTTP with a batch span processor (when an endpoint
// is configured), a meter provider whose metrics the returned handler
// serves in the Prometheus text format, and the W3C trace-context and
// baggage propagator. Unless cfg.NoGlobals is set, they become the
// OpenTelemetry globals.
//
// Serve the handler on /metrics, for example with Mux(metrics, checks...).
// Call shutdown before the process exits: it flushes the spans not yet
// exported, then stops both providers; spans recorded after it are
// dropped. (The exporter's HTTP client shares one transport with every
// OTLP/HTTP exporter of the process; its idle connection to the receiver
// closes when the receiver closes it or after 90 seconds.) Pass t.Config()
// to the Telemetry field of components that should not use the globals.
//
// When the sampler follows the parent (DefaultSampler and the
// parentbased_* settings do), the tracer provider is a wrapper over the
// SDK's that starts no span under a parent that was not sampled (see
// parentDecides); it has the SDK provider's ForceFlush. The batch span
// processor keeps the SDK's defaults and OTEL_BSP_* settings: a full queue
// drops spans rather than slowing jobs, except refusals, which have a
// queue of their own. Every sampled span that is never exported (a full
// queue, an export the exporter gave up on) is counted in
// leasehold_trace_spans_dropped_total.
func Setup(ctx context.Context, cfg SetupConfig) (t *Telemetry, metrics http.Handler, shutdown func(context.Context) error, err error) {
	if cfg.OTLPEndpoint != "" {
		if _, err := tracesURL(cfg.OTLPEndpoint); err != nil {
			return nil, nil, nil, err
		}
	}
	sampler := cfg.Sampler
	if sampler == nil {
		if sampler, err = samplerFromEnv(); err != nil {
			return nil, nil, nil, err
		}
		if sampler == nil {
			sampler = DefaultSampler()
		}
	}
	res, err := newResource(ctx, cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	mp, metrics, err := newPrometheus(res)
	if err != nil {
		return nil, nil, nil, err
	}
	var tp trace.TracerProvider = noop.NewTracerProvider()
	stopTracing := func(context.Context) error { return nil }
	if exp, err := newExporter(ctx, cfg.OTLPEndpoint); err != nil {
		_ = mp.Shutdown(ctx)
		return nil, nil, nil, err
	} else if exp != nil {
		sdk := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(newRefusalsApart(exp, mp.Meter(ScopeName))), sdktrace.WithResource(res), sdktrace.WithSampler(KeepRefusals(sampler)))
		tp, stopTracing = sdk, sdk.Shutdown
		if followsParent(sampler) {
			tp = &parentDecides{tp: sdk}
		}
	}
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	if !cfg.NoGlobals {
		otel.SetTracerProvider(tp)
		otel.SetMeterProvider(mp)
		otel.SetTextMapPropagator(prop)
	}
	shutdown = func(ctx context.Context) error {
		// Spans first: their export may take a while, and metrics need no
		// flush (Prometheus pulls them).
		terr := stopTracing(ctx)
		merr := mp.Shutdown(ctx)
		if err := errors.Join(terr, merr); err != nil {
			return fmt.Errorf("telemetry: shutdown: %w", err)
		}
		return nil
	}
	return New(Config{TracerProvider: tp, MeterProvider: mp, Propagator: prop, PartitionLabels: cfg.PartitionLabels}), metrics, shutdown, nil
}

func newResource(ctx context.Context, cfg SetupConfig) (*resource.Resource, error) {
	opts := []resource.Option{
		resource.WithAttributes(semconv.ServiceName("leasehold")),
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
		resource.WithAttributes(cfg.ResourceAttributes...),
	}
	if cfg.ServiceName != "" {
		opts = append(opts, resource.WithAttributes(semconv.ServiceName(cfg.ServiceName)))
	}
	res, err := resource.New(ctx, opts...)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("telemetry: resource: %w (check OTEL_RESOURCE_ATTRIBUTES)", err)
	}
	return res, nil
}

// newExporter returns the OTLP/HTTP span exporter for endpoint, or for the
// environment's endpoint, or nil when there is none.
func newExporter(ctx context.Context, endpoint string) (sdktrace.SpanExporter, error) {
	if strings.EqualFold(strings.TrimSpace(os.Getenv("OTEL_SDK_DISABLED")), "true") {
		return nil, nil
	}
	var opts []otlptracehttp.Option
	switch {
	case endpoint != "":
		u, err := tracesURL(endpoint)
		if err != nil {
			return nil, err
		}
		opts = append(opts, otlptracehttp.WithEndpointURL(u))
	case os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "":
		return nil, nil
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("telemetry: OTLP exporter: %w", err)
	}
	return exp, nil
}

// tracesURL turns a base URL into the OTLP/HTTP traces URL.
func tracesURL(endpoint string) (string, error) {
	u, err := url.Parse(endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("telemetry: OTLP endpoint %q: use an http or https URL such as http://127.0.0.1:4318", endpoint)
	}
	if !strings.HasSuffix(u.Path, "/v1/traces") {
		u.Path = strings.TrimSuffix(u.Path, "/") + "/v1/traces"
	}
	return u.String(), nil
}
