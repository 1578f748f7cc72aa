package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// InMemory runs a worker's jobs in memory, with no NATS server and no
// lease bucket, for tests of handlers. It is the engine of package
// workertest, which wraps it for tests: use that.
//
// It runs jobs through the worker's own code: the Job a handler gets, its
// stamps, idempotency keys and message IDs, the finals and abort markers
// of the effects protocol, the classification of an attempt's error
// (timeouts, panics, Permanent, retries up to MaxAttempts after Backoff,
// the options of the job's kind, snoozes), the dead letter and the
// events. Jobs are enqueued with a real Producer (Producer) into a job
// stream kept in memory. What needs a server is left out: every publish
// is stored at once and acknowledged, nothing is fenced or committed,
// no barrier is written, effects are not checked against the server's
// max payload, a handler that does not return is not given up on
// (HangGrace), and waits (backoffs, snoozes) are recorded, not slept.
// Jobs run one at a time, in stream order.
type InMemory struct {
	w        *Worker
	lease    leasehold.Lease // the partitions' leases: each its own partition
	producer *Producer

	mu        sync.Mutex
	runners   map[leasehold.Partition]*runner
	jobs      []*jobMsg // stored and not run yet, in stream order
	jobSeq    uint64
	ids       map[string]uint64 // job IDs stored: the stream's duplicate window
	streams   map[string]uint64 // the last sequence of each other stream
	published []*nats.Msg       // what was published beside jobs, in order
}

// InMemoryAttempt is one attempt at a job run in memory.
type InMemoryAttempt struct {
	// Job is the job as its handler saw it.
	Job *Job
	// Err is the attempt's error as the worker sees it (a timeout, a
	// panic, a failed effect included); nil when it succeeded.
	Err error
	// Counted says that the failure counts towards the job's attempts.
	Counted bool
	// Snoozed says that the handler snoozed the job (see Snooze).
	Snoozed bool
	// Wait is how long the worker would wait before the next attempt: the
	// backoff after a failure, or the snooze.
	Wait time.Duration
	// Published is what the attempt sent, in order: effects, their finals,
	// abort markers.
	Published []*nats.Msg
}

// InMemoryResult is what became of a job run in memory.
type InMemoryResult struct {
	Partition leasehold.Partition
	Seq       uint64
	Attempts  []InMemoryAttempt
	// Done says that an attempt succeeded: progress would move past the
	// job once its effects are acknowledged, which in memory they are.
	Done bool
	// DeadLetter is the job's dead letter, when it was dead-lettered.
	DeadLetter *nats.Msg
	// Stopped is the error that stopped the partition (a sink refused the
	// epoch, or the lease was lost): the job is not done, and whoever
	// holds the partition next runs it again.
	Stopped error
}

// NewInMemory returns an InMemory that runs cfg's handler under leases
// like lease, one per partition with the partition filled in: the test
// chooses the epoch, the acquisition and the holder its effects are
// stamped with. Of cfg, the connection, the lease bucket, fences and
// barriers are not used; Prefix and Partitions are required, and the
// scope defaults to Prefix.
func NewInMemory(cfg Config, lease leasehold.Lease) (*InMemory, error) {
	m := &InMemory{runners: map[leasehold.Partition]*runner{}, ids: map[string]uint64{}, streams: map[string]uint64{}}
	cfg.JetStream = memoryJS{m: m}
	cfg.Bucket, cfg.ProvisionBucket, cfg.Fences = nil, nil, nil
	if lease.Scope == "" {
		lease.Scope = cfg.Prefix
	}
	if lease.Holder == "" {
		lease.Holder = cfg.Coordinator.Worker
	}
	cfg.Coordinator.Worker = lease.Holder
	var errs []error
	if err := validPrefix(cfg.Prefix); err != nil {
		errs = append(errs, err)
	}
	if cfg.Partitions < 1 || cfg.Partitions > leasehold.MaxPartitions {
		errs = append(errs, fmt.Errorf("partitions %d: use 1 to %d", cfg.Partitions, leasehold.MaxPartitions))
	}
	if cfg.Handler == nil {
		errs = append(errs, errors.New("Handler is nil"))
	}
	if cfg.MaxAttempts < 0 || cfg.HandleTimeout < 0 || cfg.PartitionConcurrency < 0 || cfg.Order < OrderKey || cfg.Order > OrderNone {
		errs = append(errs, errors.New("MaxAttempts, HandleTimeout and PartitionConcurrency must not be negative, and Order must be OrderKey, OrderPartition or OrderNone"))
	}
	if cfg.PackEffects && cfg.StampFormat == leasehold.StampLegacy {
		errs = append(errs, errors.New("PackEffects with StampLegacy: packed effects carry the compact stamp; use StampCompact"))
	}
	if err := lease.Stamp("k").Validate(); err != nil {
		errs = append(errs, fmt.Errorf("lease: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("worker: invalid in-memory config: %w", err)
	}
	cfg.setDefaults()
	lease.Holder = cfg.Coordinator.Worker
	m.lease = lease
	tc := cfg.Telemetry
	if tc.Propagator == nil {
		tc.Propagator = cfg.Propagator
	}
	m.w = &Worker{
		cfg:     cfg,
		tel:     telemetry.New(tc),
		handler: Chain(cfg.Handler, cfg.Middleware...),
		log:     cfg.Logger.With("worker", lease.Holder, "prefix", cfg.Prefix),
		runners: map[leasehold.Partition]*runner{},
		stopped: make(chan struct{}),
	}
	p, err := NewProducer(cfg.JetStream, ProducerConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions, Propagator: cfg.Propagator, Telemetry: cfg.Telemetry})
	if err != nil {
		return nil, err
	}
	p.checked = true // the stream in memory has the partitions asked for
	m.producer = p
	return m, nil
}

// Producer enqueues jobs into the job stream in memory. Delayed and
// periodic jobs need a server and are refused.
func (m *InMemory) Producer() *Producer { return m.producer }

// Lease is the lease partition p's jobs run under.
func (m *InMemory) Lease(p leasehold.Partition) leasehold.Lease {
	l := m.lease
	l.Partition = p
	return l
}

// Pending is the number of jobs stored and not run yet.
func (m *InMemory) Pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.jobs)
}

// Published is everything published beside jobs, in order: effects,
// finals, abort markers and dead letters.
func (m *InMemory) Published() []*nats.Msg {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.published)
}

// Lose ends partition p's lease with cause, as a lost lease does: the
// running handler's context is cancelled, and emitting fails with an
// error matching leasehold.ErrLeaseLost.
func (m *InMemory) Lose(p leasehold.Partition, cause error) {
	m.runner(p).cancel(fmt.Errorf("%w: %w", leasehold.ErrLeaseLost, cause))
}

// Next runs the earliest job stored and not run yet, as the partition's
// worker would, to its end: attempts until one succeeds, the job is
// dead-lettered or the partition stops. It reports false when no job
// waits.
func (m *InMemory) Next(ctx context.Context) (InMemoryResult, bool) {
	m.mu.Lock()
	if len(m.jobs) == 0 {
		m.mu.Unlock()
		return InMemoryResult{}, false
	}
	msg := m.jobs[0]
	m.jobs = m.jobs[1:]
	m.mu.Unlock()
	part, err := leasehold.ParsePartition(strings.TrimPrefix(msg.m.Subject, m.w.cfg.Prefix+".jobs."))
	if err != nil {
		panic(fmt.Sprintf("worker: in-memory job on %s: %v", msg.m.Subject, err)) // stored by Producer
	}
	return m.run(ctx, m.runner(part), msg), true
}

func (m *InMemory) runner(p leasehold.Partition) *runner {
	m.mu.Lock()
	defer m.mu.Unlock()
	if r := m.runners[p]; r != nil {
		return r
	}
	w := m.w
	ctx, cancel := context.WithCancelCause(context.Background())
	r := &runner{
		w: w, info: m.Lease(p), p: p,
		subject: JobSubject(w.cfg.Prefix, p), output: OutputSubject(w.cfg.Prefix, p),
		log: w.log.With("partition", p, "epoch", m.lease.Epoch),
		ctx: ctx, cancel: cancel,
		done: make(chan struct{}), draining: make(chan struct{}), abandoned: make(chan struct{}),
		policy: w.cfg.partitionPolicy(), span: w.cfg.span(),
		retries: map[uint64]retryState{}, after: map[string]uint64{},
		reports: make(chan report), gone: make(chan struct{}), wake: make(chan struct{}, 1),
	}
	r.initSpans()
	m.runners[p] = r
	return r
}

// run mirrors runner.attempts for one job, without the goroutines, the
// watchdog and the acknowledgements a server gives.
func (m *InMemory) run(ctx context.Context, r *runner, msg *jobMsg) InMemoryResult {
	md := &msg.md
	seq := md.Sequence.Stream
	res := InMemoryResult{Partition: r.p, Seq: seq}
	var st retryState
	for !st.dead {
		st.runs++
		from := m.mark()
		job := r.newJob(msg, md, st.runs)
		job.wire = r.wire.Add(1)
		hctx, stop := context.WithCancelCause(context.WithValue(r.ctx, jobKey{}, job))
		unhook := context.AfterFunc(ctx, func() { stop(context.Cause(ctx)) })
		hctx = r.w.tel.Propagator.Extract(hctx, telemetry.HeaderCarrier(job.Header))
		hctx, span := r.startProcess(hctx, job)
		hctx, cancel := context.WithTimeoutCause(hctx, r.timeout(job), ErrHandleTimeout)
		r.event(hctx, Event{Kind: EventJobStarted, Job: job, Seq: seq, Attempt: st.runs})
		start := time.Now()
		err := beforeHandle(job)
		if err == nil {
			err = call(hctx, r.w.handler, job)
		}
		took := time.Since(start)
		err = attemptError(hctx, err)
		cancel()
		unhook()
		stop(nil)
		_, effErr := job.close()
		if cause := cmpErr(r.ctx.Err(), ctx.Err()); cause != nil {
			// The lease is gone, or the test's context ended: the job is
			// not done, whatever the handler returned.
			stopped := context.Cause(ctx)
			if r.ctx.Err() != nil {
				stopped = job.leaseLost(context.Cause(r.ctx))
			}
			r.measure(hctx, span, took, cmpErr(err, stopped))
			r.abort(job, job.sentSubjects())
			res.Attempts = append(res.Attempts, InMemoryAttempt{Job: job, Err: cmpErr(err, stopped), Published: m.since(from)})
			res.Stopped = stopped
			return res
		}
		if err == nil {
			err = effErr
		}
		if err == nil {
			_, _, err = job.finish(hctx, r.after, r.policy.floored(), r.watermark)
		}
		at := InMemoryAttempt{Job: job, Err: err}
		r.measure(hctx, span, took, err)
		if err == nil {
			r.event(hctx, Event{Kind: EventJobFinished, Job: job, Seq: seq, Attempt: st.runs, Duration: took})
			r.watermark = max(r.watermark, seq)
			at.Published = m.since(from)
			res.Attempts, res.Done = append(res.Attempts, at), true
			return res
		}
		r.abort(job, job.sentSubjects())
		if errors.Is(err, leasehold.ErrStaleEpoch) || errors.Is(err, leasehold.ErrLeaseLost) {
			r.event(hctx, Event{Kind: EventJobFailed, Job: job, Seq: seq, Attempt: st.runs, Err: err, Duration: took})
			at.Published = m.since(from)
			res.Attempts, res.Stopped = append(res.Attempts, at), err
			return res
		}
		v := r.judge(&st, job, err)
		at.Counted, at.Snoozed, at.Wait = v.counted, v.snoozed, v.wait
		if !v.snoozed {
			at.Err = st.err // a snooze past its bound is ErrSnoozeLimit
		}
		r.event(hctx, v.event(job, seq, st, took))
		at.Published = m.since(from)
		res.Attempts = append(res.Attempts, at)
	}
	st.dlqNonce = newNonce()
	from := m.mark()
	if _, out := r.deadLetter(msg, md, st, nil); out == 0 {
		for _, p := range m.since(from) {
			if p.Subject == DLQSubject(r.w.cfg.Prefix, r.p) {
				res.DeadLetter = p
			}
		}
		r.watermark = max(r.watermark, seq)
	} else {
		res.Stopped = context.Cause(r.ctx)
	}
	return res
}

func (m *InMemory) mark() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.published)
}

func (m *InMemory) since(i int) []*nats.Msg {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.published[i:])
}

// store keeps msg as the server would: a job in the job stream, deduped
// by its ID, anything else in the published log.
func (m *InMemory) store(msg *nats.Msg) *jetstream.PubAck {
	m.mu.Lock()
	defer m.mu.Unlock()
	prefix := m.w.cfg.Prefix
	if strings.HasPrefix(msg.Subject, prefix+".jobs.") {
		stream := JobsStream(prefix)
		id := msg.Header.Get(jetstream.MsgIDHeader)
		if seq, ok := m.ids[id]; ok && id != "" {
			return &jetstream.PubAck{Stream: stream, Sequence: seq, Duplicate: true}
		}
		m.jobSeq++
		m.ids[id] = m.jobSeq
		m.jobs = append(m.jobs, &jobMsg{m: msg, md: jetstream.MsgMetadata{
			Sequence:     jetstream.SequencePair{Stream: m.jobSeq, Consumer: m.jobSeq},
			NumDelivered: 1,
			Timestamp:    time.Now(),
			Stream:       stream,
		}})
		return &jetstream.PubAck{Stream: stream, Sequence: m.jobSeq}
	}
	stream := "memory"
	switch {
	case strings.HasPrefix(msg.Subject, prefix+".out."):
		stream = EffectsStream(prefix)
	case strings.HasPrefix(msg.Subject, prefix+".dlq."):
		stream = DLQStream(prefix)
	}
	m.streams[stream]++
	m.published = append(m.published, msg)
	return &jetstream.PubAck{Stream: stream, Sequence: m.streams[stream]}
}

// memoryJS is the part of JetStream the worker and the producer use to
// publish, answered in memory. Any other call is a bug of InMemory: it
// panics on the nil interface.
type memoryJS struct {
	jetstream.JetStream
	m *InMemory
}

var disconnected = &nats.Conn{} // its max payload is unknown: sizes are not checked

func (s memoryJS) Conn() *nats.Conn { return disconnected }

func (s memoryJS) PublishMsgAsync(msg *nats.Msg, _ ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	return &settled{msg: msg, ack: s.m.store(msg)}, nil
}

func (s memoryJS) Stream(context.Context, string) (jetstream.Stream, error) {
	return nil, fmt.Errorf("%w: the job stream is in memory", jetstream.ErrStreamNotFound)
}
