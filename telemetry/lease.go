package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/coordinator"
)

// LeaseObserver returns a coordinator.Observer that records lease events
// as short root spans (lease acquire, lease renew (failures only), lease
// lost, lease release) with leasehold.* attributes, and as metrics: leases
// held, acquisitions, losses by reason, renewal latency and the epoch of
// each partition held. A worker adds it to its coordinator by itself; add
// it to a coordinator.Config only when using the coordinator alone.
func (t *Telemetry) LeaseObserver() coordinator.Observer { return leaseObserver{t} }

type leaseObserver struct{ t *Telemetry }

func (o leaseObserver) LeaseEvent(ctx context.Context, e coordinator.Event) {
	attrs := []attribute.KeyValue{
		AttrWorker.String(e.Lease.Holder),
		AttrEpoch.Int64(int64(e.Lease.Epoch)),
	}
	if e.Member {
		attrs = append(attrs, AttrMember.Bool(true))
	} else {
		attrs = append(attrs, AttrPartition.Int64(int64(e.Lease.Partition)))
	}
	m := o.t.Metrics
	var name string
	switch e.Kind {
	case coordinator.EventAcquired:
		name = "lease acquire"
		if !e.Member {
			m.Acquisitions.Add(ctx, 1)
			m.LeasesHeld.Add(ctx, 1)
			m.SetEpoch(e.Lease.Holder, e.Lease.Partition, e.Lease.Epoch)
		}
	case coordinator.EventRenewed:
		m.RenewDuration.Record(ctx, e.Latency.Seconds())
		return // a span per renewal would drown the traces
	case coordinator.EventRenewFailed:
		name = "lease renew"
	case coordinator.EventLost:
		name = "lease lost"
		attrs = append(attrs, AttrReason.String(string(e.Reason)))
		if e.Holder != "" {
			attrs = append(attrs, AttrHolder.String(e.Holder))
		}
		if !e.Member {
			m.Losses.Add(ctx, 1, metric.WithAttributes(AttrReason.String(string(e.Reason))))
			m.LeasesHeld.Add(ctx, -1)
			m.SetEpoch(e.Lease.Holder, e.Lease.Partition, 0)
		}
	case coordinator.EventReleased:
		name = "lease release"
		if !e.Member {
			m.LeasesHeld.Add(ctx, -1)
			m.SetEpoch(e.Lease.Holder, e.Lease.Partition, 0)
		}
	default:
		return
	}
	// Lease events are not part of a request: each span is a root, at the
	// time the event happened.
	_, span := o.t.Tracer.Start(context.Background(), name,
		trace.WithTimestamp(e.Time), trace.WithAttributes(attrs...), trace.WithSpanKind(trace.SpanKindInternal))
	if e.Err != nil {
		span.RecordError(e.Err)
		if e.Kind != coordinator.EventReleased {
			span.SetStatus(codes.Error, e.Err.Error())
		}
	}
	if e.Kind == coordinator.EventLost {
		span.SetAttributes(semconv.ErrorTypeKey.String(ErrorTypeLeaseLost))
		span.SetStatus(codes.Error, "lease lost: "+string(e.Reason))
	}
	span.End(trace.WithTimestamp(e.Time))
}
