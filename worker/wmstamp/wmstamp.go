// Package wmstamp stamps what a leasehold handler publishes through any
// Watermill publisher, the way Job.Publish stamps what it publishes to
// JetStream.
//
// The contract: every message published through a stamping publisher must
// carry, as its context (message.NewMessageWithContext or SetContext), the
// context of the leasehold handler it is published for. Its metadata then
// gets the job's next stamp (Leasehold-Partition, Leasehold-Epoch,
// Leasehold-Key, Leasehold-Worker) and the context's W3C trace context. A
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
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/leasehold/leasehold/worker"
)

// ErrNoJob is matched by the error of publishing a message whose context
// does not belong to a leasehold handler.
var ErrNoJob = errors.New("wmstamp: the message's context holds no leasehold job")

// Config configures a stamping publisher.
type Config struct {
	// Propagator injects the message context's trace into its metadata.
	// Default otel.GetTextMapPropagator().
	Propagator propagation.TextMapPropagator
}

// Publisher stamps messages and hands them to the publisher it wraps.
type Publisher struct {
	pub  message.Publisher
	prop propagation.TextMapPropagator
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher wraps pub.
func NewPublisher(pub message.Publisher, cfg Config) *Publisher {
	if cfg.Propagator == nil {
		cfg.Propagator = otel.GetTextMapPropagator()
	}
	return &Publisher{pub: pub, prop: cfg.Propagator}
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
	for _, m := range msgs {
		job := worker.JobFromContext(m.Context())
		s, err := job.NextStamp()
		if err != nil {
			return fmt.Errorf("wmstamp: message %s to %s: %w", m.UUID, topic, err)
		}
		if m.Metadata == nil {
			m.Metadata = message.Metadata{}
		}
		s.SetMetadata(m.Metadata)
		p.prop.Inject(m.Context(), propagation.MapCarrier(m.Metadata))
	}
	return p.pub.Publish(topic, msgs...)
}

// Close closes the wrapped publisher.
func (p *Publisher) Close() error { return p.pub.Close() }
