// Package wmstamp stamps what a leasehold handler publishes through any
// Watermill publisher, the way Job.Publish stamps what it publishes to
// JetStream.
//
// The contract: every message published through a stamping publisher must
// carry, as its context (message.NewMessageWithContext or SetContext), the
// context of the leasehold handler it is published for. Its metadata then
// gets the job's next stamp (Leasehold-Partition, Leasehold-Epoch,
// Leasehold-Key, Leasehold-Worker) and, in W3C trace context, its own
// producer span "send <topic>", the child of the context's span. A
// message without a job in its context is refused, and so is one whose
// job's lease is gone (with an error matching leasehold.ErrLeaseLost); in
// both cases nothing of the call is published.
//
// Stamps are numbered in publishing order, sharing the job's effect
// indexes with Job.Publish and Job.Apply, so a handler re-run after a
// fail-over gives its messages the same idempotency keys as long as it
// publishes in the same order. Sinks downstream fence on the stamp.
package wmstamp

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// ErrNoJob is matched by the error of publishing a message whose context
// does not belong to a leasehold handler.
var ErrNoJob = errors.New("wmstamp: the message's context holds no leasehold job")

// Config configures a stamping publisher.
type Config struct {
	// Propagator injects the trace context of each message's send span
	// into its metadata. Default otel.GetTextMapPropagator().
	// Telemetry.Propagator, when set, wins.
	Propagator propagation.TextMapPropagator
	// Telemetry selects the providers of the publisher's spans (a producer
	// span "send <topic>" per message, the child of the message context's
	// span) and of leasehold_effects_emitted_total. Zero fields mean the
	// OpenTelemetry globals.
	Telemetry telemetry.Config
}

// Publisher stamps messages and hands them to the publisher it wraps.
type Publisher struct {
	pub message.Publisher
	tel *telemetry.Telemetry
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher wraps pub.
func NewPublisher(pub message.Publisher, cfg Config) *Publisher {
	tc := cfg.Telemetry
	if tc.Propagator == nil {
		tc.Propagator = cfg.Propagator
	}
	return &Publisher{pub: pub, tel: telemetry.New(tc)}
}

// Decorator returns a Watermill publisher decorator that stamps, for use
// where Watermill composes publishers (message.Router.AddPublisherDecorators).
func Decorator(cfg Config) message.PublisherDecorator {
	return func(pub message.Publisher) (message.Publisher, error) {
		if pub == nil {
			return nil, errors.New("wmstamp: no publisher to decorate")
		}
		return NewPublisher(pub, cfg), nil
	}
}

// Publish stamps every message, then publishes them all. If one message
// cannot be stamped, none is published.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if worker.JobFromContext(m.Context()) == nil {
			return fmt.Errorf("%w: message %s to %s: create it with message.NewMessageWithContext(ctx, ...) using the handler's ctx",
				ErrNoJob, m.UUID, topic)
		}
	}
	spans := make([]trace.Span, 0, len(msgs))
	for _, m := range msgs {
		job := worker.JobFromContext(m.Context())
		s, err := job.NextStamp()
		if err != nil {
			endAll(spans, err)
			return fmt.Errorf("wmstamp: message %s to %s: %w", m.UUID, topic, err)
		}
		if m.Metadata == nil {
			m.Metadata = message.Metadata{}
		}
		s.SetMetadata(m.Metadata)
		ctx, span := p.startSend(m, topic, s)
		p.tel.Propagator.Inject(ctx, telemetry.MetadataCarrier(m.Metadata))
		spans = append(spans, span)
	}
	err := p.pub.Publish(topic, msgs...)
	endAll(spans, err)
	if err == nil {
		p.tel.Metrics.EffectsEmitted.Add(msgs[0].Context(), int64(len(msgs)))
	}
	return err
}

// startSend starts the span of sending m to topic under stamp s.
func (p *Publisher) startSend(m *message.Message, topic string, s leasehold.Stamp) (context.Context, trace.Span) {
	template := telemetry.SubjectTemplate(topic, s.Partition)
	ctx, span := p.tel.Tracer.Start(m.Context(), telemetry.SpanName("send", template), trace.WithSpanKind(trace.SpanKindProducer))
	if span.IsRecording() {
		span.SetAttributes(append(telemetry.SendAttrs(topic, template),
			semconv.MessagingMessageID(s.Key),
			telemetry.AttrEpoch.Int64(int64(s.Epoch)),
			telemetry.AttrWorker.String(s.Worker),
		)...)
	}
	return ctx, span
}

func endAll(spans []trace.Span, err error) {
	for _, s := range spans {
		telemetry.RecordError(s, "", err)
		s.End()
	}
}

// Close closes the wrapped publisher.
func (p *Publisher) Close() error { return p.pub.Close() }
