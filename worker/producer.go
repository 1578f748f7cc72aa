package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/telemetry"
)

// ProducerConfig configures a Producer.
type ProducerConfig struct {
	// Prefix names the job stream (see ProvisionJobs). Required.
	Prefix string
	// Partitions is the job stream's partition count. Required; the first
	// enqueue checks it against the count recorded on the stream.
	Partitions int
	// Retries is how many times an enqueue whose outcome is unknown (a
	// timeout, a lost connection, no responders) is sent again, under the
	// same Nats-Msg-Id so that the stream stores it once. Default 5.
	Retries int
	// RetryWait is the first wait between retries; it doubles each time.
	// Default 50ms.
	RetryWait time.Duration
	// AckTimeout bounds the wait for one publish acknowledgement. Default 5s.
	AckTimeout time.Duration
	// Propagator injects the trace context of the enqueue's span into the
	// job's headers. Default otel.GetTextMapPropagator().
	// Telemetry.Propagator, when set, wins.
	Propagator propagation.TextMapPropagator
	// Bucket is the job stream's lease bucket, for Status and Wait, which
	// read the partitions' holders and committed progress from it.
	// Optional otherwise.
	Bucket *coordinator.Bucket
	// Telemetry selects the OpenTelemetry providers of the producer's
	// spans: a "send <prefix>.jobs.{partition}" producer span for each
	// enqueue, the child of the enqueuing context's span, whose context
	// the job carries to its handler. Zero fields mean the globals.
	Telemetry telemetry.Config
}

func (c *ProducerConfig) setDefaults() {
	if c.Retries == 0 {
		c.Retries = 5
	}
	if c.RetryWait == 0 {
		c.RetryWait = 50 * time.Millisecond
	}
	if c.AckTimeout == 0 {
		c.AckTimeout = 5 * time.Second
	}
	if c.Propagator == nil {
		c.Propagator = otel.GetTextMapPropagator()
	}
}

// Validate reports every problem with c at once.
func (c ProducerConfig) Validate() error {
	c.setDefaults()
	var errs []error
	if err := validPrefix(c.Prefix); err != nil {
		errs = append(errs, err)
	}
	if c.Partitions < 1 || c.Partitions > leasehold.MaxPartitions {
		errs = append(errs, fmt.Errorf("partitions %d: use the job stream's partition count (1 to %d)", c.Partitions, leasehold.MaxPartitions))
	}
	if c.Retries < 0 {
		errs = append(errs, fmt.Errorf("retries %d must not be negative", c.Retries))
	}
	if c.RetryWait < 0 || c.AckTimeout < 0 {
		errs = append(errs, errors.New("retry wait and ack timeout must not be negative"))
	}
	return errors.Join(errs...)
}

// Producer enqueues jobs. Its methods are safe for concurrent use.
type Producer struct {
	js        jetstream.JetStream
	cfg       ProducerConfig
	tel       *telemetry.Telemetry
	sendName  string // the enqueue span's name
	sendAttrs []attribute.KeyValue
	subjects  []string // each partition's job subject, up to subjectsKept partitions

	mu           sync.Mutex
	checked      bool // the stream's partition count matched
	schedulesOK  bool // the job stream allows message schedules
	schedulesAge bool // and has a MaxAge that schedules must be exempt from

	uniq jetstream.KeyValue // the bucket of unique jobs, once opened (unique.go)
}

// NewProducer returns a Producer that enqueues through js.
func NewProducer(js jetstream.JetStream, cfg ProducerConfig) (*Producer, error) {
	if js == nil {
		return nil, errors.New("worker: NewProducer needs a jetstream.JetStream")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("worker: invalid producer config: %w", err)
	}
	cfg.setDefaults()
	tc := cfg.Telemetry
	if tc.Propagator == nil {
		tc.Propagator = cfg.Propagator
	}
	template := cfg.Prefix + ".jobs.{partition}"
	return &Producer{
		js: js, cfg: cfg, tel: telemetry.New(tc),
		sendName: telemetry.SpanName("send", template),
		sendAttrs: []attribute.KeyValue{telemetry.MessagingSystem, semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"), semconv.MessagingDestinationTemplate(template)},
		subjects: keptSubjects(cfg.Prefix, cfg.Partitions),
	}, nil
}

// keptSubjects is the job subjects of n partitions under prefix, or nil
// past subjectsKept partitions.
func keptSubjects(prefix string, n int) []string {
	if n > subjectsKept {
		return nil
	}
	subjects := make([]string, n)
	for i := range subjects {
		subjects[i] = JobSubject(prefix, leasehold.Partition(i))
	}
	return subjects
}

// subjectsKept is the most partitions whose job subjects a Producer makes
// once, rather than on every enqueue: about 200 KB of strings at most.
const subjectsKept = 4096

// subject is partition part's job subject, which part < Partitions has.
func (p *Producer) subject(part leasehold.Partition) string {
	if uint64(part) < uint64(len(p.subjects)) { // int(part) is negative past 2^31 on 32 bits
		return p.subjects[part]
	}
	return JobSubject(p.cfg.Prefix, part)
}

// Enqueued describes a stored job.
type Enqueued struct {
	Partition leasehold.Partition
	Seq       uint64 // the job's sequence in the job stream
	ID        string // its Nats-Msg-Id
	// Duplicate is set when the stream already held a job with this ID
	// (within its duplicate window, JobsConfig.Duplicates) and dropped
	// this one; Seq is then the sequence of the job stored first. (A
	// duplicate says some job with the ID is stored, not that it is this
	// one: anyone who can publish on the subject can take an ID first.)
	Duplicate bool
	// Due is a delayed job's due time (EnqueueAt), zero for a job stored
	// at once. Until then Seq is the sequence of its schedule.
	Due time.Time
}

// Enqueue stores a job on the partition its key hashes to (Kafka's key
// partitioner: leasehold.PartitionFor) and waits for the stream's ack. The
// job carries the key's digest (leasehold.HeaderOrderKey): the jobs of one
// key run one after another, in the order they were stored, even where a
// partition runs several jobs at once.
func (p *Producer) Enqueue(ctx context.Context, key, data []byte, opts ...EnqueueOption) (Enqueued, error) {
	part := leasehold.PartitionFor(key, p.cfg.Partitions)
	o := enqueueOptionsKeyed(key, opts)
	if o.unique != nil {
		return p.enqueueUnique(ctx, part, data, o)
	}
	return p.enqueueTo(ctx, part, data, o)
}

// EnqueueTo stores a job on partition part and waits for the stream's ack.
// Without WithOrderKey the job has no order key: it is ordered by
// partition, waiting for every job stored before it on part, and no job
// stored after it starts before it.
func (p *Producer) EnqueueTo(ctx context.Context, part leasehold.Partition, data []byte, opts ...EnqueueOption) (Enqueued, error) {
	o := enqueueOptions(opts)
	if o.unique != nil {
		return p.enqueueUnique(ctx, part, data, o)
	}
	return p.enqueueTo(ctx, part, data, o)
}

func (p *Producer) enqueueTo(ctx context.Context, part leasehold.Partition, data []byte, o enqueueOpts) (e Enqueued, err error) {
	ctx, span := p.startSend(ctx, part, o.id)
	defer func() { endSpan(span, err) }()
	msg, err := p.message(ctx, part, data, o)
	if err != nil {
		return Enqueued{}, err
	}
	var last error
	for attempt := 0; attempt <= p.cfg.Retries; attempt++ {
		if attempt > 0 {
			if err := sleep(ctx, p.retryWait(attempt)); err != nil {
				return Enqueued{}, p.fail(msg, fmt.Errorf("%w (last error: %v)", err, last))
			}
		}
		actx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		ack, err := jspub.Publish(actx, p.js, msg)
		cancel()
		if err == nil {
			return p.original(ctx, enqueued(part, msg, ack)), nil
		}
		last = err
		if ctx.Err() != nil || !transientPublish(err) {
			break
		}
	}
	return Enqueued{}, p.fail(msg, last)
}

// startSend starts the span of one enqueue of the job with ID id (empty
// when the job gets a random one); the job carries its context.
func (p *Producer) startSend(ctx context.Context, part leasehold.Partition, id string) (context.Context, trace.Span) {
	ctx, span := p.tel.Tracer.Start(ctx, p.sendName, producerSpan...)
	if span.IsRecording() {
		setAttributes(span, p.sendAttrs,
			semconv.MessagingDestinationName(p.subject(part)),
			telemetry.AttrPartition.Int64(int64(part)),
			semconv.MessagingMessageID(id),
		)
	}
	return ctx, span
}

func (p *Producer) fail(msg *nats.Msg, err error) error {
	return fmt.Errorf("worker: enqueue job %s on %s: %w", msg.Header.Get(jetstream.MsgIDHeader), msg.Subject, err)
}

func (p *Producer) retryWait(attempt int) time.Duration {
	return min(p.cfg.RetryWait<<min(attempt-1, 10), 5*time.Second)
}

// message builds the job message, checking the partition and, the first
// time, the stream's partition count.
func (p *Producer) message(ctx context.Context, part leasehold.Partition, data []byte, o enqueueOpts) (*nats.Msg, error) {
	if uint64(part) >= uint64(p.cfg.Partitions) {
		return nil, fmt.Errorf("worker: enqueue: partition %d does not exist: the job stream has %d partitions (0 to %d)", part, p.cfg.Partitions, p.cfg.Partitions-1)
	}
	if err := p.check(ctx); err != nil {
		return nil, err
	}
	if err := validID(o.id); err != nil {
		return nil, err
	}
	if o.kind != "" {
		if err := ValidKind(o.kind); err != nil {
			return nil, err
		}
	}
	msg := &nats.Msg{Subject: p.subject(part), Data: data, Header: make(nats.Header, len(o.header)+4)}
	for k, vs := range o.header {
		if hasPrefixFold(k, "Nats-Rollup") || hasPrefixFold(k, "Nats-Schedule") || hasPrefixFold(k, "Nats-Scheduler") {
			return nil, fmt.Errorf("worker: enqueue: header %s is a server directive that would purge or schedule jobs; use EnqueueAt or Producer.Schedule", k)
		}
		if hasPrefixFold(k, "Leasehold-") && !strings.EqualFold(k, HeaderKind) {
			// The worker and leasehold's tools write these: a job's origin
			// (whose keys its effects take), a replay's, a stamp. Taken
			// from a caller, one would let a job emit another job's keys.
			return nil, fmt.Errorf("worker: enqueue: header %s is leasehold's own, which it writes itself (only %s may be given, and WithKind sets it)", k, HeaderKind)
		}
		if strings.EqualFold(k, "Nats-TTL") {
			// A job stream with MaxAge and schedules allows message TTLs.
			return nil, fmt.Errorf("worker: enqueue: header %s would have the server delete the job, handled or not, when it expires; bound a job's age with JobsConfig.MaxAge", k)
		}
		msg.Header[k] = vs
	}
	p.tel.Propagator.Inject(ctx, telemetry.HeaderCarrier(msg.Header))
	// The ID's and the order key's values share one array.
	vals := []string{o.id, o.order}
	msg.Header[jetstream.MsgIDHeader] = vals[0:1:1]
	if o.order != "" {
		msg.Header[leasehold.HeaderOrderKey] = vals[1:2:2]
	}
	if o.kind != "" {
		for k := range msg.Header {
			if strings.EqualFold(k, HeaderKind) {
				delete(msg.Header, k)
			}
		}
		msg.Header[HeaderKind] = []string{o.kind}
	}
	if !o.at.IsZero() {
		if err := p.schedule(ctx, msg, part, o); err != nil {
			return nil, err
		}
	}
	return msg, nil
}

// check reads the stream's partition count once, retrying a request that
// got no answer (a node failing over, a connection reconnecting).
func (p *Producer) check(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.checked {
		return nil
	}
	var err error
	for attempt := 0; attempt <= p.cfg.Retries; attempt++ {
		if attempt > 0 {
			if serr := sleep(ctx, p.retryWait(attempt)); serr != nil {
				return fmt.Errorf("%w (last error: %v)", serr, err)
			}
		}
		cctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		err = streamPartitions(cctx, p.js, p.cfg.Prefix, p.cfg.Partitions)
		cancel()
		if err == nil {
			p.checked = true
			return nil
		}
		if ctx.Err() != nil || !transientPublish(err) {
			return err
		}
	}
	return err
}

func validID(id string) error {
	if len(id) > leasehold.MaxKeyLen {
		return fmt.Errorf("worker: job ID is %d bytes long; the limit is %d", len(id), leasehold.MaxKeyLen)
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c <= ' ' || c == 0x7f {
			return fmt.Errorf("worker: job ID %q holds a space or control byte, which a header cannot carry", id)
		}
	}
	return nil
}

func enqueued(part leasehold.Partition, msg *nats.Msg, ack *jetstream.PubAck) Enqueued {
	e := Enqueued{Partition: part, Seq: ack.Sequence, ID: msg.Header.Get(jetstream.MsgIDHeader), Duplicate: ack.Duplicate}
	if due := msg.Header.Get(HeaderDue); due != "" {
		e.Due, _ = time.Parse(time.RFC3339, due)
	}
	return e
}

// original points a duplicate at the job stored first: the stream's
// duplicate window spans partitions, so the job with the ID may sit on
// another partition than this key's, or be a delayed job's schedule. It
// reads the stored message; when that fails, e keeps this enqueue's
// partition.
func (p *Producer) original(ctx context.Context, e Enqueued) Enqueued {
	if !e.Duplicate {
		return e
	}
	s, err := p.js.Stream(ctx, JobsStream(p.cfg.Prefix))
	if err != nil {
		return e
	}
	m, err := s.GetMsg(ctx, e.Seq)
	if err != nil {
		return e
	}
	subject := m.Subject
	e.Due = time.Time{}
	if target := m.Header.Get(hdrScheduleTarget); target != "" {
		subject = target
		e.Due, _ = time.Parse(time.RFC3339, m.Header.Get(HeaderDue))
	}
	if part, err := leasehold.ParsePartition(strings.TrimPrefix(subject, p.cfg.Prefix+".jobs.")); err == nil && int(part) < p.cfg.Partitions {
		e.Partition = part
	}
	return e
}

// Batch enqueues many jobs without waiting for each ack: Enqueue and
// EnqueueTo send, Wait collects the acks and resends what failed. A Batch
// is safe for concurrent use; start a new one after Wait.
type Batch struct {
	p       *Producer
	mu      sync.Mutex
	pending []pendingJob
}

type pendingJob struct {
	part leasehold.Partition
	msg  *nats.Msg
	fut  jetstream.PubAckFuture
	err  error // the send failed
}

// Batch starts a batch of asynchronous enqueues.
func (p *Producer) Batch() *Batch { return &Batch{p: p} }

// Enqueue sends a job to the partition its key hashes to, carrying the
// key's order key, as Producer.Enqueue does.
func (b *Batch) Enqueue(ctx context.Context, key, data []byte, opts ...EnqueueOption) error {
	return b.enqueueTo(ctx, leasehold.PartitionFor(key, b.p.cfg.Partitions), data, enqueueOptionsKeyed(key, opts))
}

// EnqueueTo sends a job to partition part, with no order key unless
// WithOrderKey gives it one (see Producer.EnqueueTo). An error means the
// job could not be sent and is not part of the batch.
func (b *Batch) EnqueueTo(ctx context.Context, part leasehold.Partition, data []byte, opts ...EnqueueOption) error {
	return b.enqueueTo(ctx, part, data, enqueueOptions(opts))
}

func (b *Batch) enqueueTo(ctx context.Context, part leasehold.Partition, data []byte, o enqueueOpts) error {
	// The span covers the send; Wait collects the ack.
	if o.unique != nil {
		return errors.New("worker: a Batch does not enqueue unique jobs: use Producer.Enqueue")
	}
	ctx, span := b.p.startSend(ctx, part, o.id)
	msg, err := b.p.message(ctx, part, data, o)
	if err != nil {
		endSpan(span, err)
		return err
	}
	pj := pendingJob{part: part, msg: msg}
	pj.fut, pj.err = b.p.publishAsync(ctx, msg)
	endSpan(span, pj.err)
	b.mu.Lock()
	b.pending = append(b.pending, pj)
	b.mu.Unlock()
	return nil
}

// Len is the number of jobs in the batch.
func (b *Batch) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.pending)
}

// Wait waits for every job of the batch to be stored, sending again (under
// the same ID) those whose outcome is unknown, and returns their positions
// in the order they were enqueued. The batch is empty afterwards. On error,
// the jobs before the first failure in the result were stored; the others
// may have been.
func (b *Batch) Wait(ctx context.Context) ([]Enqueued, error) {
	b.mu.Lock()
	pending := b.pending
	b.pending = nil
	b.mu.Unlock()
	out := make([]Enqueued, 0, len(pending))
	for i := range pending {
		e, err := b.p.await(ctx, &pending[i])
		if err != nil {
			return out, err
		}
		out = append(out, e)
	}
	return out, nil
}

// publishAsync sends msg without waiting for its acknowledgement, waiting
// for room for as long as ctx lasts when too many are outstanding. The
// publish takes no options: an option costs three allocations on every
// job, and the client's own stall wait (200 ms) only sets how often ctx
// is looked at.
func (p *Producer) publishAsync(ctx context.Context, msg *nats.Msg) (jetstream.PubAckFuture, error) {
	for {
		fut, err := p.js.PublishMsgAsync(msg)
		if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) || ctx.Err() != nil {
			return fut, err
		}
	}
}

// await waits for one job's ack, resending on an unknown outcome.
func (p *Producer) await(ctx context.Context, pj *pendingJob) (Enqueued, error) {
	for attempt := 0; ; attempt++ {
		var err error
		if pj.err != nil {
			err = pj.err
		} else {
			var ack *jetstream.PubAck
			ack, err = awaitAck(ctx, pj.fut, p.cfg.AckTimeout)
			if err == nil {
				return p.original(ctx, enqueued(pj.part, pj.msg, ack)), nil
			}
		}
		if ctx.Err() != nil || !transientPublish(err) || attempt >= p.cfg.Retries {
			return Enqueued{}, p.fail(pj.msg, err)
		}
		if err := sleep(ctx, p.retryWait(attempt+1)); err != nil {
			return Enqueued{}, p.fail(pj.msg, err)
		}
		pj.fut, pj.err = p.publishAsync(ctx, pj.msg)
	}
}

// awaitAck waits for a publish future, at most timeout.
func awaitAck(ctx context.Context, fut jetstream.PubAckFuture, timeout time.Duration) (*jetstream.PubAck, error) {
	select {
	case ack := <-fut.Ok():
		return ack, nil
	case err := <-fut.Err():
		return nil, err
	default:
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case ack := <-fut.Ok():
		return ack, nil
	case err := <-fut.Err():
		return nil, err
	case <-t.C:
		return nil, fmt.Errorf("no ack within %v: %w", timeout, nats.ErrTimeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// transientPublish reports whether a publish failed without a definite
// answer from the stream, so that sending it again (under the same
// Nats-Msg-Id) may succeed and cannot store it twice.
func transientPublish(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return false
	}
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, jetstream.ErrAsyncPublishTimeout) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, jetstream.ErrTooManyStalledMsgs) ||
		errors.Is(err, nats.ErrSlowConsumer) || errors.Is(err, nats.ErrStaleConnection)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
