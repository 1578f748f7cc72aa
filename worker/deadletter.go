package worker

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// Headers a dead letter carries beside the job's own headers, the stamp
// of the lease it was dead-lettered under, and the job's origin
// (leasehold.HeaderOrigin: where it was first stored, its own place unless
// it was replayed or moved; one that could not be read is dropped, and the
// error says why).
const (
	HeaderError    = "Leasehold-Error"    // the last failure, on one line
	HeaderAttempts = "Leasehold-Attempts" // attempts run by the worker that gave up
	HeaderSubject  = "Leasehold-Subject"  // the job's subject
	HeaderSeq      = "Leasehold-Seq"      // the job's sequence in the job stream
	HeaderJobID    = "Leasehold-Job-Id"   // the job's Nats-Msg-Id
	// HeaderStack is the stack of a handler's panic (PanicError.Stack),
	// quoted as a Go string on one line (strconv.Unquote gives it back);
	// HeaderError says "panic: <value> at <file:line>".
	HeaderStack = "Leasehold-Stack"
)

// maxStackHeader bounds the stack a dead letter carries, before quoting.
const maxStackHeader = 8 << 10

// maxErrorHeader bounds the error text a dead letter carries.
const maxErrorHeader = 2048

// DeadLetterKey is the idempotency key of the dead letter of the job at
// sequence seq of partition p: a re-run that dead-letters the job again is
// stored once.
func DeadLetterKey(scope string, p leasehold.Partition, seq uint64) string {
	return scope + "." + p.String() + "." + strconv.FormatUint(seq, 10) + ".dlq"
}

// deadLetter publishes the job to the partition's dead-letter subject and
// waits for the server to store it (at most EffectTimeout) before the
// partition goes on: dead letters are rare, and EventJobDeadLettered, the
// metric and the log line say that it is stored, before the next job's
// events. It runs in the job's goroutine, and stops retrying once halt is
// closed. Its outcome is handed on like an effect's, so progress moves past
// the job only once the dead letter is stored; one the server refuses, or
// does not acknowledge in time, sends the partition back to the job, which
// is dead-lettered again.
func (r *runner) deadLetter(m jetstream.Msg, md *jetstream.MsgMetadata, st retryState, halt <-chan struct{}) ([]jetstream.PubAckFuture, outcome) {
	msg := &nats.Msg{Subject: DLQSubject(r.w.cfg.Prefix, r.p), Data: m.Data(), Header: nats.Header{}}
	jobID := jobIDOf(m.Headers())
	for k, vs := range m.Headers() {
		switch {
		case strings.EqualFold(k, HeaderKind):
			// The kind routes a replay to the handler it was meant for.
			msg.Header[HeaderKind] = vs
		case hasPrefixFold(k, "Nats-"), hasPrefixFold(k, "Leasehold-"):
			// Server directives and an upstream stamp must not apply to
			// the dead letter.
		default:
			msg.Header[k] = vs
		}
	}
	errText := "unknown error"
	if st.err != nil {
		errText = oneLine(st.err.Error(), maxErrorHeader)
	}
	msg.Header.Set(HeaderError, errText)
	var pe *PanicError
	if errors.As(st.err, &pe) && len(pe.Stack) > 0 {
		msg.Header.Set(HeaderStack, strconv.Quote(string(pe.Stack[:min(len(pe.Stack), maxStackHeader)])))
	}
	msg.Header.Set(HeaderAttempts, strconv.Itoa(st.runs))
	msg.Header.Set(HeaderSubject, m.Subject())
	msg.Header.Set(HeaderSeq, strconv.FormatUint(md.Sequence.Stream, 10))
	// The job's identity goes with it: a replay runs it under its
	// origin's keys, not the replay's place.
	r.originOf(m.Headers(), md.Sequence.Stream).SetHeader(msg.Header)
	if jobID != "" {
		msg.Header.Set(HeaderJobID, jobID)
	}
	stamp := r.info.Stamp(DeadLetterKey(r.info.Scope, r.p, md.Sequence.Stream))
	// The dead letter belongs to the job's trace: a child of its enqueue.
	ctx := r.w.tel.Propagator.Extract(r.ctx, telemetry.HeaderCarrier(m.Headers()))
	ctx, span := r.startSend(ctx, msg.Subject, stamp)
	span.SetAttributes(telemetry.AttrSeq.Int64(int64(md.Sequence.Stream)), telemetry.AttrAttempt.Int(st.runs))
	r.stampHeader(ctx, msg.Header, stamp, st.dlqNonce)
	for attempt := 1; ; attempt++ {
		fut, err := r.publishAsync(r.ctx, msg)
		if err == nil {
			done, out := r.awaitStored(fut)
			if out != 0 {
				endSpan(span, context.Cause(r.ctx))
				return nil, out
			}
			if done.err != nil {
				endSpan(span, done.err)
				return []jetstream.PubAckFuture{done}, 0
			}
			span.End()
			r.w.tel.Metrics.JobsDeadLettered.Add(ctx, 1)
			r.event(ctx, Event{Kind: EventJobDeadLettered, Seq: md.Sequence.Stream, Attempt: st.runs, Stamp: stamp, Subject: msg.Subject, Err: st.err})
			r.log.Error("job dead-lettered", "seq", md.Sequence.Stream, "attempts", st.runs, "dlq", msg.Subject, "err", st.err)
			if len(headerValues(m.Headers(), hdrSchedule)) > 0 {
				r.removeSchedule(m.Subject(), strings.Join(headerValues(m.Headers(), hdrScheduleTarget), ","), md.Sequence.Stream)
			}
			return []jetstream.PubAckFuture{done}, 0
		}
		if r.ctx.Err() != nil {
			endSpan(span, err)
			return nil, outLost
		}
		wait := min(50*time.Millisecond<<min(attempt-1, 6), 2*time.Second)
		r.log.Warn("dead-lettering a job failed; retrying", "seq", md.Sequence.Stream, "err", err)
		if out := r.sleep(wait, halt); out != 0 {
			endSpan(span, err)
			return nil, out
		}
	}
}

// awaitStored waits for fut's outcome, at most EffectTimeout, and returns
// it as a settled future (a future's outcome can be received once, and the
// partition's window receives it again). A non-zero outcome means the
// lease ended first.
func (r *runner) awaitStored(fut jetstream.PubAckFuture) (*settled, outcome) {
	t := time.NewTimer(r.w.cfg.EffectTimeout)
	defer t.Stop()
	done := &settled{msg: fut.Msg()}
	select {
	case done.ack = <-fut.Ok():
	case done.err = <-fut.Err():
	case <-t.C:
		done.err = fmt.Errorf("no acknowledgement within %v: %w", r.w.cfg.EffectTimeout, jetstream.ErrAsyncPublishTimeout)
	case <-r.ctx.Done():
		return nil, outLost
	}
	return done, 0
}

// settled is a publish whose outcome is known: a jetstream.PubAckFuture
// that gives it on every call.
type settled struct {
	msg *nats.Msg
	ack *jetstream.PubAck
	err error
}

func (f *settled) Ok() <-chan *jetstream.PubAck {
	ch := make(chan *jetstream.PubAck, 1)
	if f.ack != nil {
		ch <- f.ack
	}
	return ch
}

func (f *settled) Err() <-chan error {
	ch := make(chan error, 1)
	if f.err != nil {
		ch <- f.err
	}
	return ch
}

func (f *settled) Msg() *nats.Msg { return f.msg }

// removeSchedule removes the schedule stored at seq of the job stream,
// once its dead letter is stored. A schedule on a partition subject
// is not leasehold's (its schedules live on subjects of their own): a
// forger's or a mistaken publisher's, which the server would go on firing
// at its target for ever. Its copy in the dead-letter stream is what is
// kept. It waits at most a few seconds, and says what to run by hand when
// it cannot remove it.
func (r *runner) removeSchedule(subject, target string, seq uint64) {
	stream := JobsStream(r.w.cfg.Prefix)
	manual := fmt.Sprintf("nats stream rmm %s %d", stream, seq)
	// Not under the lease's context: once the dead letter is stored the
	// partition's progress moves past the schedule, and a lease lost
	// meanwhile must not leave it firing.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.ctx), 5*time.Second)
	defer cancel()
	s, err := r.w.cfg.JetStream.Stream(ctx, stream)
	if err == nil {
		err = s.DeleteMsg(ctx, seq)
	}
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		r.log.Error("a schedule stored on a partition subject keeps firing: it could not be removed from the job stream", "seq", seq, "subject", subject, "err", err, "remove_with", manual)
		return
	}
	r.log.Warn("removed a schedule stored on a partition subject, which would have gone on firing jobs; its dead letter keeps it", "seq", seq, "subject", subject, "target", target)
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// oneLine makes s fit a header value: no line breaks, at most n bytes.
func oneLine(s string, n int) string {
	s = strings.NewReplacer("\r\n", " | ", "\n", " | ", "\r", " | ").Replace(s)
	if len(s) > n {
		s = s[:n-3] + "..."
	}
	return s
}
