package telemetry_test

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/telemetry"
)

// BenchmarkSpanFloor measures what the OpenTelemetry SDK itself costs for
// one span of the kind a worker records for every job, outside any
// pipeline: always sampled, through a batch span processor to an exporter
// that drops it; bare, with the eight attributes of a process span, and
// with those and the W3C context written into and read from NATS headers,
// as a job or effect carries it. A job makes three such spans (enqueue,
// process, effect send), so three times the last figure is the least that
// tracing every job can cost, whatever leasehold does around it; compare
// it with the CPU per job of BenchmarkTelemetry in ./worker.
//
//	go test ./telemetry -run '^$' -bench SpanFloor -benchmem
func BenchmarkSpanFloor(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(dropSpans{}))
	defer tp.Shutdown(context.Background())
	tr := tp.Tracer("bench")
	attrs := []attribute.KeyValue{
		telemetry.MessagingSystem,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationTemplate("orders.jobs.{partition}"),
		telemetry.AttrPartition.Int64(3),
		telemetry.AttrEpoch.Int64(1796053021705963),
		telemetry.AttrWorker.String("worker-1"),
		telemetry.AttrSeq.Int64(12345),
	}
	kind := trace.WithSpanKind(trace.SpanKindConsumer)
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			_, span := tr.Start(context.Background(), "process orders.jobs.{partition}", kind)
			span.End()
		}
	})
	b.Run("attributes", func(b *testing.B) {
		for b.Loop() {
			_, span := tr.Start(context.Background(), "process orders.jobs.{partition}", kind)
			span.SetAttributes(attrs...)
			span.End()
		}
	})
	prop := propagation.TraceContext{}
	b.Run("attributes+propagation", func(b *testing.B) {
		for b.Loop() {
			ctx, span := tr.Start(context.Background(), "process orders.jobs.{partition}", kind)
			span.SetAttributes(attrs...)
			h := nats.Header{}
			prop.Inject(ctx, telemetry.HeaderCarrier(h))
			_ = prop.Extract(context.Background(), telemetry.HeaderCarrier(h))
			span.End()
		}
	})
}

type dropSpans struct{}

func (dropSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (dropSpans) Shutdown(context.Context) error                             { return nil }

// BenchmarkUnsampledJob measures what tracing costs a job whose trace was
// not sampled (nine in ten under DefaultSampler), outside any pipeline:
// the enqueue's span and its context written into the job's headers, the
// worker's read of it, its process span and the context written into the
// effect's headers, and the sink's read and process span. "sdk" is the
// SDK's provider as it is; "setup" is the same provider as Setup hands it
// out, which starts no SDK span under a parent that was not sampled.
//
//	go test ./telemetry -run '^$' -bench UnsampledJob -benchmem
func BenchmarkUnsampledJob(b *testing.B) {
	sdk := sdktrace.NewTracerProvider(sdktrace.WithSampler(telemetry.KeepRefusals(sdktrace.ParentBased(sdktrace.NeverSample()))), sdktrace.WithBatcher(dropSpans{}))
	defer sdk.Shutdown(context.Background())
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	producer, consumer := trace.WithSpanKind(trace.SpanKindProducer), trace.WithSpanKind(trace.SpanKindConsumer)
	for _, c := range []struct {
		name string
		tp   trace.TracerProvider
	}{{"sdk", sdk}, {"setup", telemetry.ParentDecides(sdk)}} {
		tr := c.tp.Tracer("bench")
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				ctx, send := tr.Start(context.Background(), "send orders.jobs.{partition}", producer)
				job := nats.Header{"Nats-Msg-Id": {"job-1"}}
				prop.Inject(ctx, telemetry.HeaderCarrier(job))
				send.End()

				ctx, process := tr.Start(prop.Extract(context.Background(), telemetry.HeaderCarrier(job)), "process orders.jobs.{partition}", consumer)
				effect := nats.Header{}
				prop.Inject(ctx, telemetry.HeaderCarrier(effect))
				effect["Leasehold-Scope"] = []string{"orders"}
				effect["Leasehold-Partition"] = []string{"3"}
				effect["Leasehold-Epoch"] = []string{"1796053021705963"}
				effect["Leasehold-Key"] = []string{"orders/3/12345/0"}
				effect["Nats-Msg-Id"] = []string{"orders/3/12345/0@1796053021705963~0123456789abcdef"}
				process.End()

				_, apply := tr.Start(prop.Extract(context.Background(), telemetry.HeaderCarrier(effect)), "process orders.out.{partition}", consumer)
				apply.End()
			}
		})
	}
}
