package bench

import (
	"context"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/telemetry"
)

// spanFloor is the CPU time per job, in µs, that the OpenTelemetry SDK and
// its OTLP/HTTP exporter alone take to record and export every span a job
// makes with every trace sampled, to the same receiver as the tracing
// rows: no NATS, no worker, no sink. A job makes four: the enqueue's send,
// the attempt's process, the effect's send and the sink's process, each
// with as many attributes as leasehold gives it, and its W3C context
// written into and read from NATS headers twice, as the job and its effect
// carry it. The batcher blocks rather than drop a span (Setup's drops
// them), so every span is paid for: whatever leasehold does around its
// spans, tracing and exporting every job costs at least this.
func (e *env) spanFloor(ctx context.Context, o *otlpSink, n int) (float64, error) {
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(o.endpoint()+"/v1/traces"))
	if err != nil {
		return 0, fmt.Errorf("span floor: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()),
		sdktrace.WithSpanProcessor(sdktrace.NewBatchSpanProcessor(exp, sdktrace.WithBlocking())))
	shutdown := tp.Shutdown
	tel := telemetry.New(telemetry.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}})
	tr, prop := tel.Tracer, tel.Propagator
	var (
		producer = trace.WithSpanKind(trace.SpanKindProducer)
		consumer = trace.WithSpanKind(trace.SpanKindConsumer)
		send     = []attribute.KeyValue{telemetry.MessagingSystem, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationTemplate("floor.jobs.{partition}")}
		process = []attribute.KeyValue{telemetry.MessagingSystem, semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process"),
			semconv.MessagingDestinationTemplate("floor.jobs.{partition}"), telemetry.AttrPartition.Int64(3),
			telemetry.AttrEpoch.Int64(1796053021705963), telemetry.AttrWorker.String("worker-1")}
		effect = []attribute.KeyValue{telemetry.MessagingSystem, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName("floor.out.3"), semconv.MessagingDestinationTemplate("floor.out.{partition}"),
			telemetry.AttrEpoch.Int64(1796053021705963), telemetry.AttrWorker.String("worker-1")}
		sinkAttrs = []attribute.KeyValue{telemetry.MessagingSystem, semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process"),
			semconv.MessagingDestinationTemplate("floor.out.{partition}"), telemetry.AttrSink.String("memory"), telemetry.AttrPartition.Int64(3),
			telemetry.AttrEpoch.Int64(1796053021705963), telemetry.AttrWorker.String("worker-1")}
		scratch = make([]attribute.KeyValue, 0, 12)
	)
	with := func(shared []attribute.KeyValue, own ...attribute.KeyValue) []attribute.KeyValue {
		return append(append(scratch[:0], shared...), own...)
	}
	cpu0 := cpuTime()
	for i := range n {
		if i%1024 == 0 && ctx.Err() != nil {
			break
		}
		id := strconv.Itoa(i)
		job := nats.Header{}
		sctx, s := tr.Start(context.Background(), "send floor.jobs.{partition}", producer)
		s.SetAttributes(with(send, semconv.MessagingDestinationName("floor.jobs.3"), telemetry.AttrPartition.Int64(3), semconv.MessagingMessageID(id))...)
		prop.Inject(sctx, telemetry.HeaderCarrier(job))
		s.End()

		pctx, p := tr.Start(prop.Extract(context.Background(), telemetry.HeaderCarrier(job)), "process floor.jobs.{partition}", consumer)
		p.SetAttributes(with(process, telemetry.AttrSeq.Int64(int64(i)))...)
		out := nats.Header{}
		ectx, s2 := tr.Start(pctx, "send floor.out.{partition}", producer)
		s2.SetAttributes(with(effect, semconv.MessagingMessageID(id))...)
		prop.Inject(ectx, telemetry.HeaderCarrier(out))
		s2.End()
		p.End()

		_, k := tr.Start(prop.Extract(context.Background(), telemetry.HeaderCarrier(out)), "process floor.out.{partition}", consumer)
		k.SetAttributes(with(sinkAttrs, telemetry.AttrKey.String(id), telemetry.AttrOutcome.String("applied"))...)
		k.End()
	}
	// Shutdown exports what is queued: its cost is the floor's too.
	err = shutdown(context.WithoutCancel(ctx))
	cpu := (cpuTime() - cpu0).Seconds() * 1e6 / float64(n)
	if err != nil {
		return 0, fmt.Errorf("span floor: %w", err)
	}
	if ctx.Err() != nil {
		return 0, ctx.Err()
	}
	return cpu, nil
}
