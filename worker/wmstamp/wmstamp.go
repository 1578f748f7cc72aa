// Package wmstamp stamps what leasehold holders publish through any
// Watermill publisher, the way Job.Publish stamps what a job publishes to
// JetStream.
//
// A message gets its stamp from its context (message.NewMessageWithContext
// or SetContext):
//   - the context of a leasehold job handler (worker.JobFromContext): the
//     job's next stamp, numbered with the job's other effects, so that a job
//     re-run after a fail-over gives its messages the same idempotency keys
//     as long as it publishes in the same order;
//   - any other context, when Config.Lease is set: a stamp of that lease (a
//     named lock's, a partition's *coordinator.Lease), for code that is not
//     a job, such as a Watermill Router handler (see Middleware for its
//     keys).
//
// A message gets the stamp's headers (Leasehold-Scope, -Partition, -Epoch,
// -Acquisition, -Key, -Worker) in its metadata and, in W3C trace context,
// its own producer span "send <topic>", the child of the context's span.
// A message with no stamp source is refused with ErrNoJob before anything
// of the call is published; one whose lease is gone, with an error
// matching leasehold.ErrLeaseLost.
//
// A job's messages are published one at a time, each as one of the job's
// effects (through Job.Apply): a publish that fails fails the job's
// attempt whatever its handler returns, so that the job runs again and
// publishes again under the same keys, and every later publish of that
// attempt is refused with the same error, so that no message of it gets a
// key another message of the job has in a run that succeeds. The
// messages of a lease are published in one call of the wrapped publisher;
// a failed call can be retried and gives its messages the same keys.
package wmstamp

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"weak"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// ErrNoJob is matched by the error of publishing a message whose context
// belongs to no leasehold job, through a publisher without Config.Lease.
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
	// Lease stamps the messages whose context holds no leasehold job.
	// *coordinator.Lease satisfies it. Nil: such messages are refused with
	// ErrNoJob.
	Lease Lease
}

// Publisher stamps messages and hands them to the publisher it wraps.
type Publisher struct {
	pub   message.Publisher
	tel   *telemetry.Telemetry
	lease Lease

	// failed holds, per job attempt, the first publish that failed.
	failed sync.Map // weak.Pointer[worker.Job] -> error
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher wraps pub.
func NewPublisher(pub message.Publisher, cfg Config) *Publisher {
	tc := cfg.Telemetry
	if tc.Propagator == nil {
		tc.Propagator = cfg.Propagator
	}
	return &Publisher{pub: pub, tel: telemetry.New(tc), lease: cfg.Lease}
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

// Publish stamps the messages and publishes them, in order. Publishing no
// message does nothing. If a message has no stamp source, nothing is
// published.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	for _, m := range msgs {
		if m == nil {
			return fmt.Errorf("wmstamp: publish to %s: a nil message", topic)
		}
		if worker.JobFromContext(m.Context()) == nil && p.lease == nil {
			return fmt.Errorf("%w: message %s to %s: create it with message.NewMessageWithContext(ctx, ...) using the handler's ctx, or give the publisher a Config.Lease",
				ErrNoJob, m.UUID, topic)
		}
	}
	// Consecutive messages of one lease go out in one call.
	var batch []*message.Message
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := p.publishLeased(topic, batch)
		batch = batch[:0]
		return err
	}
	for _, m := range msgs {
		job := worker.JobFromContext(m.Context())
		if job == nil {
			batch = append(batch, m)
			continue
		}
		if err := flush(); err != nil {
			return err
		}
		if err := p.publishJob(job, topic, m); err != nil {
			return err
		}
	}
	return flush()
}

// publishJob publishes m as one effect of job: Job.Apply numbers it with
// the job's effects, counts it, and fails the attempt if it fails.
func (p *Publisher) publishJob(job *worker.Job, topic string, m *message.Message) error {
	wp := weak.Make(job)
	if err, ok := p.failed.Load(wp); ok {
		return fmt.Errorf("wmstamp: message %s to %s is not published: an earlier publish of this attempt failed, and the attempt runs again: %w", m.UUID, topic, err.(error))
	}
	err := job.Apply(m.Context(), &effectPublisher{p: p, topic: topic, m: m}, topic, m.Payload)
	if err != nil {
		if _, loaded := p.failed.LoadOrStore(wp, err); !loaded {
			runtime.AddCleanup(job, func(k weak.Pointer[worker.Job]) { p.failed.Delete(k) }, wp)
		}
	}
	return err
}

// effectPublisher is the sink Job.Apply writes one message to: the
// wrapped publisher.
type effectPublisher struct {
	p     *Publisher
	topic string
	m     *message.Message
}

var _ sink.Sink = (*effectPublisher)(nil)

func (e *effectPublisher) Apply(ctx context.Context, effects ...sink.Effect) error {
	if len(effects) != 1 {
		return sink.ErrEmptyBatch
	}
	span := e.p.stamp(e.m, e.topic, effects[0].Stamp)
	err := e.p.pub.Publish(e.topic, e.m)
	endSend(span, err)
	if err != nil {
		return fmt.Errorf("wmstamp: publish message %s to %s: %w", e.m.UUID, e.topic, err)
	}
	return nil
}

// Advance and Fence are never called: Job.Apply only applies.
func (e *effectPublisher) Advance(context.Context, leasehold.Lease) error {
	return errors.New("wmstamp: a publisher is not a fence")
}

func (e *effectPublisher) Fence(context.Context, leasehold.FenceID) (leasehold.FenceState, error) {
	return leasehold.FenceState{}, errors.New("wmstamp: a publisher is not a fence")
}

// stamp writes s into m's metadata and starts m's send span, whose trace
// context m carries.
func (p *Publisher) stamp(m *message.Message, topic string, s leasehold.Stamp) trace.Span {
	if m.Metadata == nil {
		m.Metadata = message.Metadata{}
	}
	s.SetMetadata(m.Metadata)
	ctx, span := p.startSend(m.Context(), topic, s)
	p.tel.Propagator.Inject(ctx, telemetry.MetadataCarrier(m.Metadata))
	return span
}

// endSend ends a send span with the publish's outcome.
func endSend(span trace.Span, err error) {
	telemetry.RecordError(span, "", err)
	span.End()
}

// startSend starts the span of sending a message to topic under stamp s.
func (p *Publisher) startSend(ctx context.Context, topic string, s leasehold.Stamp) (context.Context, trace.Span) {
	template := telemetry.SubjectTemplate(topic, s.Partition)
	ctx, span := p.tel.Tracer.Start(ctx, telemetry.SpanName("send", template), trace.WithSpanKind(trace.SpanKindProducer))
	if span.IsRecording() {
		span.SetAttributes(append(telemetry.SendAttrs(topic, template),
			semconv.MessagingMessageID(s.Key),
			telemetry.AttrEpoch.Int64(int64(s.Epoch)),
			telemetry.AttrWorker.String(s.Worker),
		)...)
	}
	return ctx, span
}

// Close closes the wrapped publisher.
func (p *Publisher) Close() error { return p.pub.Close() }
