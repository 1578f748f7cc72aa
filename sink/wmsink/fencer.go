// Package wmsink fences Watermill messages: a subscriber decorator and a
// HandlerMiddleware that let a handler see a message only when its stamp
// (leasehold metadata) is admitted.
//
// # Log position
//
// A message is judged against each fence as it stood at the message's
// position in its log, as the stream sink judges an effect log: the
// fences are raised by the barriers (and higher epochs) that come before
// the message in the log, never by ones that came after it. A message
// that preceded a barrier is admitted however late it is delivered again
// (nacked on a database blip, redelivered after its AckWait), so an
// effect whose job was committed is never refused for arriving after the
// take-over. A former holder's message after the barrier is refused.
//
// Positions come from JetStream: build the watermill-nats subscriber with
// the Fencer's Unmarshaler (pkg/jetstream) or NATSUnmarshaler (pkg/nats,
// JetStream on), which read each message's stream and sequence from the
// server's metadata, and give the Fencer the JetStream connection
// (Config.JetStream), through which it reads the log where its messages
// leave a gap (before the first one it sees, or between two consumers'
// messages), so that every barrier before a message has been seen when
// the message is judged. Judging is then a function of the log alone, and
// exact with any number of subscriptions, consumers and processes on a
// log, in any delivery order, across restarts, as long as the log keeps
// its messages: a stream with limits retention and no MaxAge, MaxMsgs,
// MaxBytes or MaxMsgsPerSubject, never purged. A log that can lose
// messages is refused (ErrLogNotKept), since a barrier it drops is gone
// with them.
//
// # Arrival order
//
// A pub/sub that gives no positions (gochannel, watermill-nats' pkg/nats
// with its default Unmarshaler, core NATS) leaves only the order messages
// arrive in, and that is not enough: a message nacked before a barrier
// and delivered again after it arrives after the barrier, as a former
// holder's message published after the barrier does, and nothing in
// either tells them apart. The first was committed (its job's progress
// moved past it before the take-over) and must be applied; the second
// must be refused. No rule of arrival can admit the one and refuse the
// other, and the Fencer cannot know which messages are still to be
// delivered without their positions. New therefore refuses
// Config.ArrivalOrder (ErrArrivalOrder): judge by position instead.
//
// Config.UnsafeArrivalOrder judges messages without a position in the
// order they arrive all the same, against fences this process keeps in
// memory, and loses a committed effect whenever a message is delivered
// after a later one: a nack, an AckWait expiry, a consumer group, a
// restart. It is exact only where nothing is ever delivered again after a
// later message: one process reading a pub/sub that hands out messages in
// publishing order and redelivers a nacked message before the next (a
// gochannel with BlockPublishUntilSubscriberAck, one subscriber per
// topic; without it gochannel sends each message from a goroutine of its
// own, and a nacked one is sent again after later ones), or a caller of
// Fence that feeds a log in order and applies each message before the
// next. Its refusals say they were judged in
// arrival order. The fences do not survive a restart, and there is no
// Fence shared across processes: decisions there would be a check at one
// store and a write at another.
//
// # Outcomes
//
// A stale or split-brain message, or one whose epoch the lease bucket
// never issued (Config.Verifier), is acked and dropped: it is reported
// with its error to the Observer, counted (Dropped), logged and traced,
// and never redelivered. A barrier (leasehold.HeaderBarrier) raises its
// fence and is acked without reaching the handler. A message without a
// valid stamp is reported as a bad stamp, moved to Config.Poison when
// one is set (carrying only leasehold's headers and trace context), and
// acked: it is not an effect, and nacking it would only have it
// delivered again at once. When a decision cannot be taken (the log or
// the lease bucket does not answer), the message is nacked after a
// backoff, so that a failure is retried at a bounded rate and shows in the
// Failed decisions.
//
// # Jobs' effects
//
// A Fencer does not apply a job's effects all or none, as the stream sink
// does: it hands each admitted effect to the handler as it comes, and
// Watermill's concurrent handlers and redeliveries would leave nothing to
// hold a job's effects back by. So the effects an attempt published before
// it failed (a handler error, a dead letter, a timeout) reach the handler.
// The abort markers such an attempt leaves (leasehold.HeaderAbort) are acked
// without reaching it, reported sink.Aborted. Where a failed job's effects
// must not apply, put a stream sink between the log and Watermill: its
// downstream stream holds only completed jobs' effects.
//
// A Fencer decides; it does not order the handlers' writes. Watermill runs
// handlers concurrently and redelivers out of order, so a destination
// that keeps one value per key must dedupe by Leasehold-Key or compare
// stamps itself.
package wmsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// ErrArrivalOrder is matched by the error of New given Config.ArrivalOrder:
// judged in arrival order, a committed effect that is redelivered after a
// barrier is refused (see the package documentation).
var ErrArrivalOrder = errors.New("wmsink: arrival order loses committed effects")

// ErrNoPosition is matched by the error of a message that carries no log
// position when the Fencer judges by position: it did not come through a
// subscriber built with the Fencer's Unmarshaler. The message is nacked,
// not judged.
var ErrNoPosition = errors.New("wmsink: the message carries no log position")

// Config configures a Fencer.
type Config struct {
	// JetStream reads the logs messages come from (see the package
	// documentation). Required unless UnsafeArrivalOrder is set.
	JetStream jetstream.JetStream
	// ArrivalOrder is refused by New with an error matching
	// ErrArrivalOrder, which says how to judge by log position instead.
	//
	// Deprecated: judged in arrival order, a committed effect redelivered
	// after a barrier is refused. Build the subscriber with Unmarshaler or
	// NATSUnmarshaler and set JetStream; see UnsafeArrivalOrder for the
	// few pub/subs where arrival order is exact.
	ArrivalOrder bool
	// UnsafeArrivalOrder judges messages that carry no log position in the
	// order they arrive, against fences kept in this process. A message
	// delivered after a later one (nacked, redelivered after its AckWait,
	// handed to another member of a consumer group) is judged after it:
	// an effect of a committed job that comes again after the barrier of
	// a take-over is refused, and lost. Set it only for one process
	// reading a pub/sub that never delivers a message after a later one,
	// or to call Fence (see the package documentation). Messages with a
	// position are judged by it all the same.
	UnsafeArrivalOrder bool
	// Name names the sink in decisions and logs. Default "watermill".
	Name string
	// Verifier, when set, turns on verified epochs (see sink.EpochCheck).
	Verifier sink.Verifier
	// Observer receives every decision. Optional.
	Observer sink.Observer
	// Logger receives rate-limited drop lines. Default slog.Default().
	Logger *slog.Logger
	// Telemetry selects the providers of the Fencer's spans and metrics: a
	// consumer span "process <topic>" for each message, the child of the
	// span that published it (from the trace context in its metadata).
	// Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
	// Poison, when set, receives a copy of each message with a bad stamp
	// on PoisonTopic: its UUID, payload, leasehold headers and trace
	// context, and Leasehold-Bad-Stamp saying what is wrong. Nothing else
	// of its metadata is copied: a header of the server's (Nats-*) would
	// change how the copy is stored.
	Poison      message.Publisher
	PoisonTopic string
	// MaxBackoff bounds the wait before a message whose decision failed is
	// nacked. Default 5 s.
	MaxBackoff time.Duration
	// RequestTimeout bounds each read of a log. Default 5 s.
	RequestTimeout time.Duration
}

// Fencer fences messages by their stamps.
type Fencer struct {
	cfg   Config
	rep   *sink.Reporter
	check *sink.EpochCheck
	token string // marks the positions this Fencer's Unmarshaler wrote

	mu     sync.Mutex
	logs   map[string]*logState
	locks  map[leasehold.FenceID]*sync.Mutex
	fences map[leasehold.FenceID]leasehold.FenceState // arrival order

	failures failStreak
}

// New returns a Fencer.
func New(cfg Config) (*Fencer, error) {
	if cfg.ArrivalOrder {
		return nil, fmt.Errorf("%w: a message nacked before a take-over's barrier and delivered again after it is refused, though its job was committed. "+
			"Judge by log position: build the watermill-nats subscriber with SubscriberConfig.Unmarshaler set to fencer.Unmarshaler(nil) (pkg/jetstream) "+
			"or fencer.NATSUnmarshaler(nil) (pkg/nats with JetStream on), and set Config.JetStream. "+
			"Only where no message is ever delivered after a later one (one process; a gochannel with BlockPublishUntilSubscriberAck) set Config.UnsafeArrivalOrder instead", ErrArrivalOrder)
	}
	if cfg.JetStream == nil && !cfg.UnsafeArrivalOrder {
		return nil, errors.New("wmsink: Config.JetStream is required to judge messages by their log position " +
			"(build the subscriber with fencer.Unmarshaler or fencer.NATSUnmarshaler); " +
			"only for a pub/sub that never delivers a message after a later one set Config.UnsafeArrivalOrder, which refuses a committed effect redelivered after a barrier")
	}
	if (cfg.Poison == nil) != (cfg.PoisonTopic == "") {
		return nil, errors.New("wmsink: Config.Poison and Config.PoisonTopic go together")
	}
	if cfg.Name == "" {
		cfg.Name = "watermill"
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 5 * time.Second
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = 5 * time.Second
	}
	if cfg.UnsafeArrivalOrder {
		log := cfg.Logger
		if log == nil {
			log = slog.Default()
		}
		log.Warn("wmsink: messages without a log position are judged in arrival order: one delivered again after a barrier it preceded is refused, and its committed effect lost; build the subscriber with the Fencer's Unmarshaler and set Config.JetStream",
			"sink", cfg.Name)
	}
	return &Fencer{
		cfg:    cfg,
		rep:    sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check:  sink.NewEpochCheck(cfg.Verifier),
		token:  newToken(),
		logs:   make(map[string]*logState),
		locks:  make(map[leasehold.FenceID]*sync.Mutex),
		fences: make(map[leasehold.FenceID]leasehold.FenceState),
	}, nil
}

// Dropped returns how many messages of fence id were refused.
func (f *Fencer) Dropped(id leasehold.FenceID) uint64 { return f.rep.Dropped(id) }

// State returns fence id as the messages decided so far leave it: in
// arrival order, or at the end of the logs read so far, the highest.
func (f *Fencer) State(id leasehold.FenceID) leasehold.FenceState {
	f.mu.Lock()
	st := f.fences[id]
	logs := make([]*logState, 0, len(f.logs))
	for _, l := range f.logs {
		logs = append(logs, l)
	}
	f.mu.Unlock()
	for _, l := range logs {
		if s := l.latest(id); s.Epoch > st.Epoch {
			st = s
		}
	}
	return st
}

// action is what happens to a decided message.
type action int

const (
	handle action = iota + 1 // an admitted effect: the handler gets it
	ack                      // decided for good without the handler
	retry                    // the decision failed: nack after a backoff
)

// decision is the Fencer's verdict on one delivery of a message.
type decision struct {
	act   action
	err   error
	ctx   context.Context // carries the message's span
	span  trace.Span
	stamp leasehold.Stamp
	pos   Position
}

// judgement is a stamp judged against a fence.
type judgement struct {
	v          leasehold.Verdict
	raise      bool
	fence      leasehold.FenceState // what the stamp was judged against
	unverified error                // the epoch was never issued: refused
}

// judgeChecked judges st against fs and, where st would raise the fence,
// asks the Config's Verifier whether its acquisition was issued: an epoch
// that never was is refused as unverified, and a check that cannot answer
// is an error.
func (f *Fencer) judgeChecked(ctx context.Context, fs leasehold.FenceState, st leasehold.Stamp) (judgement, error) {
	v, raise := leasehold.Judge(fs, st)
	j := judgement{v: v, raise: raise, fence: fs}
	if v != leasehold.Admit || !raise {
		return j, nil
	}
	if err := f.check.Check(ctx, st); err != nil {
		if errors.Is(err, sink.ErrUnverifiedEpoch) {
			j.unverified = err
			return j, nil
		}
		return j, err
	}
	return j, nil
}

// decide judges one delivery of msg, reporting every outcome but an
// admitted effect's, which is reported once its handler has run.
func (f *Fencer) decide(msg *message.Message) decision {
	ctx := msg.Context()
	pos, positioned := f.takePosition(msg.Metadata)
	st, serr := leasehold.StampFromMetadata(msg.Metadata)
	ctx, span := f.rep.StartProcess(ctx, telemetry.MetadataCarrier(msg.Metadata), message.SubscribeTopicFromCtx(ctx), st)
	d := decision{ctx: ctx, span: span, stamp: st, pos: pos}
	base := sink.Decision{Stamp: st, Subject: message.SubscribeTopicFromCtx(ctx), Position: pos.Seq}
	var j judgement
	var err error
	arrival := false
	switch {
	case positioned && f.cfg.JetStream != nil:
		j, err = f.judgeAt(ctx, pos, st, serr == nil)
	case serr != nil:
	case f.cfg.UnsafeArrivalOrder:
		j, err = f.judgeArrival(ctx, st)
		arrival = true
	default:
		err = fmt.Errorf("%w: build the watermill-nats subscriber with Unmarshaler: fencer.Unmarshaler(nil) (pkg/jetstream) or fencer.NATSUnmarshaler(nil) (pkg/nats, JetStream on) (message %s, key %q)", ErrNoPosition, msg.UUID, st.Key)
	}
	if err != nil {
		return f.failedDecision(d, base, err)
	}
	if serr != nil {
		base.Outcome, base.Err = sink.BadStamp, fmt.Errorf("wmsink: message %s: %w", msg.UUID, serr)
		f.rep.Report(ctx, base)
		if perr := f.poison(msg, base.Err); perr != nil {
			return f.failedDecision(d, base, perr)
		}
		d.act = ack
		span.End()
		return d
	}
	base.Max, base.MaxAcquisition, base.Holder = j.fence.Epoch, j.fence.Acquisition, j.fence.Holder
	barrier := isBarrier(msg.Metadata)
	switch {
	case j.unverified != nil:
		base.Outcome, base.Err = outcomeOf(j.unverified), j.unverified
		f.rep.Report(ctx, base)
		d.act = ack
	case j.v != leasehold.Admit:
		if !(barrier && j.v == leasehold.Stale) {
			// (A late barrier of an earlier acquisition moves nothing.)
			base.Outcome, base.Err = sink.Refused(j.v), leasehold.Refusal(j.fence, st, j.v)
			if arrival {
				base.Err = fmt.Errorf("%w (judged in arrival order, not by log position: had the message preceded the barrier in its log, its job was committed and this refusal loses its effect)", base.Err)
			}
			f.rep.Report(ctx, base)
		}
		d.act = ack
	case barrier:
		if j.raise {
			base.Outcome, base.Max, base.MaxAcquisition, base.Holder = sink.Advanced, st.Epoch, st.Acquisition, st.Worker
			f.rep.Report(ctx, base)
		}
		d.act = ack
	case isAbort(msg.Metadata):
		base.Outcome, base.Max = sink.Aborted, st.Epoch
		f.rep.Report(ctx, base)
		d.act = ack
	case isPacked(msg.Metadata):
		// Handed on, its body would reach the handler as one effect.
		base.Outcome = sink.BadStamp
		base.Err = fmt.Errorf("wmsink: message %s packs several effects (%s, from a worker with Config.PackEffects): the fencer hands on one effect a message and does not read packs; put a stream sink runner in front, or turn packing off in the workers: %w",
			msg.UUID, leasehold.HeaderPack, leasehold.ErrBadPack)
		f.rep.Report(ctx, base)
		if perr := f.poison(msg, base.Err); perr != nil {
			return f.failedDecision(d, base, perr)
		}
		d.act = ack
	default:
		f.failures.reset()
		d.act = handle
		return d
	}
	f.failures.reset()
	span.End()
	return d
}

func (f *Fencer) failedDecision(d decision, base sink.Decision, err error) decision {
	base.Outcome, base.Err = sink.Failed, err
	f.rep.Report(d.ctx, base)
	d.span.End()
	d.act, d.err = retry, err
	return d
}

// handled reports the outcome of an admitted message's handler.
func (f *Fencer) handled(d decision, err error) {
	o := sink.Decision{Outcome: sink.Accepted, Stamp: d.stamp, Subject: message.SubscribeTopicFromCtx(d.ctx), Position: d.pos.Seq, Max: d.stamp.Epoch}
	if err != nil {
		o.Outcome, o.Err = sink.Failed, err
	}
	f.rep.Report(d.ctx, o)
}

// backoff waits before a failed decision's nack: 10 ms doubling with
// every failure in a row, up to MaxBackoff, or until done is closed.
func (f *Fencer) backoff(done <-chan struct{}) {
	wait := min(f.cfg.MaxBackoff, 10*time.Millisecond<<min(f.failures.add(), 10))
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
	case <-done:
	}
}

// failStreak counts decisions that failed in a row.
type failStreak struct {
	mu sync.Mutex
	n  int
}

func (s *failStreak) add() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	return s.n - 1
}

func (s *failStreak) reset() {
	s.mu.Lock()
	s.n = 0
	s.mu.Unlock()
}

// isPacked reports whether md carries leasehold.HeaderPack, in any
// spelling: a message packing several effects (see leasehold.Unpack).
func isPacked(md map[string]string) bool {
	for k := range md {
		if strings.EqualFold(k, leasehold.HeaderPack) {
			return true
		}
	}
	return false
}

// isAbort reports whether md is a job attempt's abort marker: no effect.
func isAbort(md map[string]string) bool {
	for k, v := range md {
		if strings.EqualFold(k, leasehold.HeaderAbort) && v == "1" {
			return true
		}
	}
	// The compact form's (leasehold.HeaderMark) is read by the root's
	// parser, as every stamp and mark is.
	m, err := leasehold.JobMarkFromMetadata(md)
	return err == nil && m.Abort
}

func isBarrier(md map[string]string) bool {
	if _, ok := md[leasehold.HeaderBarrier]; ok {
		return true
	}
	for k := range md {
		if strings.EqualFold(k, leasehold.HeaderBarrier) {
			return true
		}
	}
	return false
}
