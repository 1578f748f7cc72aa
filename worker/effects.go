package worker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// EmitOption adjusts one published effect.
type EmitOption func(*emitOpts)

type emitOpts struct {
	header nats.Header
}

// EmitHeader adds headers to the effect. The stamp, trace context and
// Nats-Msg-Id are set by the worker and win over these.
func EmitHeader(h nats.Header) EmitOption { return func(o *emitOpts) { o.header = h } }

// EffectError reports an effect that could not be published; the job's
// attempt fails and is run again.
type EffectError struct {
	Subject string
	Key     string // the effect's idempotency key
	Err     error
}

func (e *EffectError) Error() string {
	return fmt.Sprintf("worker: effect %s to %s: %v", e.Key, e.Subject, e.Err)
}

// Unwrap returns the publish error.
func (e *EffectError) Unwrap() error { return e.Err }

// Publish publishes an effect to subject, stamped with the job's partition,
// epoch and the next idempotency key, with the trace context of its "send"
// span (a child of ctx's span) and a Nats-Msg-Id made of the key and the
// epoch, so that the publisher's own retries are stored once (see
// stampHeader for why the epoch is part of it).
// It does not wait for the stream's acknowledgement: the job counts as done
// once every effect is acknowledged, and fails (and runs again) if one is
// not. After the lease is lost it returns an error matching
// leasehold.ErrLeaseLost and publishes nothing.
//
// The effect carries the job and the attempt, and the attempt's latest
// effect on each subject is held back until the handler returns: if it
// returns nil, that effect leaves marked final, so that a stream sink
// applies the job's effects on the subject all together; if the attempt
// fails, it never leaves, and the ones that did are closed by an abort
// marker (see output.go). A job of one effect sends one message. With
// Config.PackEffects, every effect of the attempt on a subject is held,
// and they leave together, packed in one message (leasehold.HeaderPack).
func (j *Job) Publish(ctx context.Context, subject string, data []byte, opts ...EmitOption) error {
	var extra nats.Header
	if len(opts) > 0 {
		// Only here: options take o's address, which moves it to the
		// heap, and most effects have none.
		var o emitOpts
		for _, opt := range opts {
			opt(&o)
		}
		extra = o.header
	}
	j.mu.Lock()
	stamp, err := j.reserve()
	j.mu.Unlock()
	if err != nil {
		j.fail(err)
		return err
	}
	e := &effectMsg{Msg: nats.Msg{Subject: subject, Data: data, Header: make(nats.Header, len(extra)+j.r.headerRoom())}}
	msg := &e.Msg
	for k, vs := range extra {
		// The stamp's and the job mark's headers, in either form and any
		// spelling, are the worker's alone: a caller's copy beside the
		// worker's would make the effect malformed (two forms, or two
		// values), refused by every sink. So is HeaderPack: a sink would
		// read the effect's data as packed effects, and refuse it.
		if !leasehold.IsStampHeader(k) && !isPackName(k) {
			msg.Header[k] = vs
		}
	}
	sctx, span := j.r.startEffect(ctx, subject, stamp)
	j.r.w.tel.Propagator.Inject(sctx, telemetry.HeaderCarrier(msg.Header))
	// What the effect adds to a packed body, measured while its headers
	// are its own: trace context and the caller's.
	var size int
	if j.r.w.cfg.PackEffects {
		if err := packableHeader(msg.Header); err != nil {
			err = Permanent(&EffectError{Subject: subject, Key: stamp.Key, Err: err})
			endSpan(span, err)
			j.fail(err)
			return err
		}
		size = leasehold.PackedSize(leasehold.PackedEffect{Key: stamp.Key, Header: msg.Header, Data: data})
	}
	var lines int // of the stamp, mark and message ID, not written yet
	switch {
	case j.r.w.cfg.StampFormat == leasehold.StampCompact && j.r.w.cfg.PackEffects:
		// Held, and packed unless it is the last: its stamp, mark and
		// message ID are written when it leaves (sendHeld), and
		// meanwhile counted in its size. A caller's Nats-Msg-Id goes
		// now, as setWire's would replace it: counted beside the
		// worker's, it made an effect that fits too large.
		delete(msg.Header, jetstream.MsgIDHeader)
		lines = wireLines(stamp, leasehold.JobMark{Job: j.Seq, Attempt: j.wire}, j.nonce[:])
	case j.r.w.cfg.StampFormat == leasehold.StampCompact:
		e.setWire(stamp, leasehold.JobMark{Job: j.Seq, Attempt: j.wire}, j.nonce[:])
	default:
		stamp.SetHeaderAs(msg.Header, j.r.w.cfg.StampFormat)
		e.id[0] = MessageID(stamp, string(j.nonce[:]))
		msg.Header[jetstream.MsgIDHeader] = e.id[:]
		leasehold.JobMark{Job: j.Seq, Attempt: j.wire}.SetHeaderAs(msg.Header, j.r.w.cfg.StampFormat)
	}
	if j.replayed() {
		// A job stored again (a replay) emits its origin's keys: the
		// origin tells a sink whose keys they are.
		j.Origin().SetHeader(msg.Header)
	}
	// Sized as the final it may become: the final's headers are the
	// largest.
	room := j.r.finalRoom(j.Seq)
	if err := j.r.checkEffect(msg, room+unwrittenSize(msg.Header, lines)); err != nil {
		err = &EffectError{Subject: subject, Key: stamp.Key, Err: err}
		endSpan(span, err)
		j.fail(err)
		return err
	}
	// What the subject held so far and may no longer hold goes now, and
	// this one is held until the handler returns (see output.go).
	held := heldEffect{msg: msg, key: stamp.Key, size: size, unwritten: lines}
	if j.r.w.cfg.StampFormat == leasehold.StampCompact {
		held.wire = e
	}
	rest, prev, err := j.hold(held, room)
	if err == nil && prev.msg != nil {
		err = j.sendHeld(ctx, rest, prev, leasehold.JobMark{Job: j.Seq, Attempt: j.wire})
	}
	if err != nil {
		endSpan(span, err)
		j.fail(err)
		return err
	}
	span.End()
	j.r.w.tel.Metrics.EffectsEmitted.Add(ctx, 1)
	j.r.event(ctx, Event{Kind: EventEffectEmitted, Job: j, Seq: j.Seq, Attempt: j.Attempt, Stamp: stamp, Subject: subject})
	return nil
}

// effectMsg is an effect's message with the values of its message ID,
// stamp and mark headers, in one allocation: they live as long as the
// message.
type effectMsg struct {
	nats.Msg
	id   [1]string
	wire [2]string // the compact stamp and mark (setWire)
	// The room setWire left after the three values in their buffer, for
	// the mark of the attempt's final (setFinal); nil once used.
	spare []byte
}

// finalMarkExtra is what a final's mark adds to the attempt's mark:
// three numbers (effects, after, floor) of at most 20 digits, each after
// a space. setWire leaves room for the attempt's mark and that.
const finalMarkExtra = 3 * 21

// setWire writes the compact stamp st, the mark m and the message ID of
// st and nonce into e's header, which holds neither form of the stamp
// or the mark (Publish keeps a caller's copies out): the three values
// are cut from one string, where SetHeaderAs and MessageID made three,
// and each value's slice is e's own.
func (e *effectMsg) setWire(st leasehold.Stamp, m leasehold.JobMark, nonce []byte) {
	// Built on the stack, then copied to a buffer of their length and
	// the final's mark: a bound taken from the values' lengths left the
	// buffer twice the size the values need.
	var tmp [wireTmp]byte
	b, stampEnd, markEnd := appendWire(tmp[:0], st, m, nonce)
	buf := make([]byte, len(b), len(b)+markEnd-stampEnd+finalMarkExtra)
	copy(buf, b)
	all := unsafe.String(unsafe.SliceData(buf), len(buf))
	e.wire[0], e.wire[1], e.id[0] = all[:stampEnd], all[stampEnd:markEnd], all[markEnd:]
	e.spare = buf[len(buf):]
	e.Header[leasehold.HeaderStamp] = e.wire[0:1:1]
	if markEnd > stampEnd {
		e.Header[leasehold.HeaderMark] = e.wire[1:2:2]
	}
	e.Header[jetstream.MsgIDHeader] = e.id[:]
}

// wireTmp is the room on the stack for the three values of setWire.
const wireTmp = 384

// appendWire appends the compact stamp st, the mark m and the message ID
// of st and nonce to b, and returns where the stamp and the mark end.
func appendWire(b []byte, st leasehold.Stamp, m leasehold.JobMark, nonce []byte) ([]byte, int, int) {
	b = st.AppendCompact(b)
	stampEnd := len(b)
	b = m.AppendCompact(b)
	markEnd := len(b)
	b = append(b, st.Key...)
	b = append(b, '@')
	b = strconv.AppendUint(b, uint64(st.Epoch), 10)
	b = append(b, '~')
	b = append(b, nonce...)
	return b, stampEnd, markEnd
}

// wireLines is the size of the header lines setWire writes for st, m
// and nonce. With Config.PackEffects an effect that is packed, and not the
// pack's last, never carries its stamp, mark and message ID as headers,
// and building them only to drop them took about two fifths of the CPU of
// such an effect's Publish: Publish counts them instead, and sendHeld
// writes them when the effect leaves.
func wireLines(st leasehold.Stamp, m leasehold.JobMark, nonce []byte) int {
	var tmp [wireTmp]byte
	b, stampEnd, markEnd := appendWire(tmp[:0], st, m, nonce)
	const line = len(": \r\n")
	n := len(leasehold.HeaderStamp) + line + stampEnd + len(jetstream.MsgIDHeader) + line + len(b) - markEnd
	if markEnd > stampEnd {
		n += len(leasehold.HeaderMark) + line + markEnd - stampEnd
	}
	return n
}

// unwrittenSize is what lines of header not written yet add to h on the
// wire (headerSize): the lines, and the header's framing when h is empty.
func unwrittenSize(h nats.Header, lines int) int {
	if lines == 0 || len(h) > 0 {
		return lines
	}
	return lines + headerFrame
}

// setFinal writes m, the mark of the attempt's final, over the mark
// setWire wrote, in the room it left: SetHeader would look through the
// header for the mark's headers in either form and make a value and its
// slice, where the header here is known to hold e's own, in e.wire[1].
// The bytes are the spare room's, which no string held before.
func (e *effectMsg) setFinal(m leasehold.JobMark) {
	b := m.AppendCompact(e.spare[:0])
	e.spare = nil
	e.wire[1] = unsafe.String(unsafe.SliceData(b), len(b))
	e.Header[leasehold.HeaderMark] = e.wire[1:2:2]
}

// send publishes one of j's effects without waiting for its
// acknowledgement, which close hands to the runner.
func (j *Job) send(ctx context.Context, msg *nats.Msg) error {
	// The last look before the message leaves: a process frozen since the
	// stamp was reserved must not send it now.
	if err := j.sendable(); err != nil {
		return err
	}
	fut, err := j.r.publishAsync(ctx, msg)
	if err != nil {
		return &EffectError{Subject: msg.Subject, Key: effectKey(msg), Err: err}
	}
	j.mu.Lock()
	if j.futs == nil {
		j.futs = j.futBuf[:0]
	}
	j.futs = append(j.futs, fut)
	j.output(msg.Subject).sent = true
	j.mu.Unlock()
	return nil
}

// Emit publishes an effect to the partition's default output,
// OutputSubject(prefix, partition). See Publish.
func (j *Job) Emit(ctx context.Context, data []byte, opts ...EmitOption) error {
	return j.Publish(ctx, j.r.output, data, opts...)
}

// Apply writes one effect to a sink, synchronously, stamped with the next
// idempotency key and carrying the context's trace. The sink fences it:
// an error matching leasehold.ErrStaleEpoch means another worker has taken
// the partition over, and a handler that returns it stops the partition.
func (j *Job) Apply(ctx context.Context, s sink.Sink, subject string, data []byte) error {
	stamp, err := j.NextStamp()
	if err != nil {
		j.fail(err)
		return err
	}
	h := make(map[string][]string, 2)
	j.r.w.tel.Propagator.Inject(ctx, telemetry.HeaderCarrier(h))
	if err := s.Apply(ctx, sink.Effect{Stamp: stamp, Subject: subject, Data: data, Header: h}); err != nil {
		err = fmt.Errorf("worker: apply effect %s to %s: %w", stamp.Key, subject, err)
		j.fail(err)
		return err
	}
	j.r.w.tel.Metrics.EffectsEmitted.Add(ctx, 1)
	j.r.event(ctx, Event{Kind: EventEffectEmitted, Job: j, Seq: j.Seq, Attempt: j.Attempt, Stamp: stamp, Subject: subject})
	return nil
}

// stampHeader writes the stamp, the trace context and the Nats-Msg-Id.
//
// The message ID is the idempotency key, the epoch and a nonce of the
// attempt, not the key alone. With the key alone, a zombie's effect stored
// in the log (and refused by the sink as stale) would make the stream drop
// its successor's re-run of the same job as a duplicate, and acknowledge
// it: the successor would commit past a job whose effect no sink ever
// applied. Without the nonce, anyone who can publish on the subject could
// store a message under the ID a worker is about to use, and the worker's
// real effect would be dropped as its duplicate; the nonce is not known
// before the attempt runs. A re-run stores its effects again, and sinks
// dedupe them by key.
//
// The stamp is written in the form Config.StampFormat names, and the job
// mark a caller adds after it follows that form (leasehold.JobMark's
// SetHeader writes the form of the stamp it finds).
func (r *runner) stampHeader(ctx context.Context, h nats.Header, s leasehold.Stamp, nonce string) {
	r.w.tel.Propagator.Inject(ctx, telemetry.HeaderCarrier(h))
	r.setStamp(h, s, nonce)
}

// setStamp is stampHeader without the trace context.
func (r *runner) setStamp(h nats.Header, s leasehold.Stamp, nonce string) {
	s.SetHeaderAs(h, r.w.cfg.StampFormat)
	h[jetstream.MsgIDHeader] = []string{MessageID(s, nonce)}
}

// headerRoom is how many headers the worker adds to an effect: trace
// context (two), the stamp, the job mark, the message ID and an origin in
// the compact form; the stamp's six and the job's five in the legacy one.
func (r *runner) headerRoom() int {
	if r.w.cfg.StampFormat == leasehold.StampLegacy {
		return 14
	}
	return 6
}

// effectKey is the idempotency key msg's stamp carries, for an error
// message: "" when it has none that reads.
func effectKey(msg *nats.Msg) string {
	s, _ := leasehold.StampFromHeader(msg.Header)
	return s.Key
}

// MessageID is the Nats-Msg-Id the worker gives a message stamped with s
// in the attempt whose nonce is given: "<key>@<epoch>~<nonce>".
func MessageID(s leasehold.Stamp, nonce string) string {
	var num [20]byte
	return s.Key + "@" + string(strconv.AppendUint(num[:0], uint64(s.Epoch), 10)) + "~" + nonce
}

// newNonce returns 8 random bytes, hex-encoded.
func newNonce() string {
	x := newNonceBytes()
	return string(x[:])
}

// newNonceBytes is newNonce's value in an array: a Job keeps its attempt's
// nonce in one, which costs the job no allocation of its own.
func newNonceBytes() [16]byte {
	var b [8]byte
	_, _ = rand.Read(b[:])
	var x [16]byte
	hex.Encode(x[:], b[:])
	return x
}

// publishAsync sends msg without waiting for its acknowledgement, waiting
// for room when too many are outstanding: at least EffectTimeout, then for
// as long as ctx and the lease last. A ctx that ends during the wait ends
// it at once: a handler whose context ended must be able to return within
// HangGrace, whatever EffectTimeout. One that had ended before (a final,
// sent once the attempt's handler returned) waits EffectTimeout.
//
// The publish takes no options: an option costs allocations on every
// effect, and a stall is rare. The client's own stall wait (200 ms) is
// shorter than EffectTimeout, so the loop counts the time itself; only an
// EffectTimeout shorter still is passed as the stall wait of the first
// publish: the ones after it wait the client's own, or a stall spins on
// the publish, one try per EffectTimeout, for as long as it lasts.
func (r *runner) publishAsync(ctx context.Context, msg *nats.Msg) (jetstream.PubAckFuture, error) {
	var since time.Time
	live := ctx.Err() == nil
	for {
		var fut jetstream.PubAckFuture
		var err error
		if r.w.cfg.EffectTimeout < stallWait && since.IsZero() {
			fut, err = r.w.cfg.JetStream.PublishMsgAsync(msg, jetstream.WithStallWait(r.w.cfg.EffectTimeout))
		} else {
			fut, err = r.w.cfg.JetStream.PublishMsgAsync(msg)
		}
		if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
			return fut, err
		}
		if since.IsZero() {
			since = time.Now().Add(-min(stallWait, r.w.cfg.EffectTimeout))
		}
		if live && ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %w", err, context.Cause(ctx))
		}
		if time.Since(since) < r.w.cfg.EffectTimeout {
			continue
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %w", err, context.Cause(ctx))
		}
		if r.lease.Err() != nil {
			return nil, err
		}
	}
}

// stallWait is how long a publish without a stall wait of its own waits
// for room before it fails with jetstream.ErrTooManyStalledMsgs (the
// client's default).
const stallWait = 200 * time.Millisecond

// effectTransient reports whether an effect failure is the transport's
// (a timeout, a lost connection, a stream that is not answering): such a
// failure retries the job without using up an attempt, since the handler
// did nothing wrong and dead-lettering jobs through a NATS outage would
// lose nothing but help nobody.
func effectTransient(err error) bool {
	var ee *EffectError
	return errors.As(err, &ee) && transientPublish(ee.Err)
}

// publishSync publishes msg and waits for its acknowledgement, at most
// timeout, and no longer than the connection lasts: a server restart must
// not hold the partition for the whole timeout (see jspub). An answer
// lost on a connection that stays up (a stream leader that stepped down)
// is asked for again every syncTry(timeout); msg carries a Nats-Msg-Id,
// so a copy the old leader stored is taken for a duplicate.
func (r *runner) publishSync(ctx context.Context, msg *nats.Msg, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	_, tries, err := jspub.PublishRetry(ctx, r.w.cfg.JetStream, msg, syncTry(timeout))
	if tries > 1 {
		r.log.Info("a marker's acknowledgement was lost and it was sent again", "subject", msg.Subject, "tries", tries, "err", err)
	}
	return err
}

// apiTry is how long the runner waits for the answer to try n (from 0) of
// a JetStream API request it makes again when unanswered (a job
// consumer's create, the cancels' lookup and watch): 2 s, doubling with
// each try up to 16 s. A request lost with the connection costs little;
// a server slow to answer still gets the time. It does not follow
// EffectTimeout, which bounds effects: a tiny one must not fail every
// request.
func apiTry(n int) time.Duration {
	return 2 * time.Second << min(n, 3)
}

// syncTry is how long publishSync waits for one try's answer: long
// enough for a busy server's, short enough that a lost one costs little
// more than the election of the stream's next leader. A copy sent again
// too soon costs the server a duplicate to drop.
func syncTry(timeout time.Duration) time.Duration {
	return min(timeout, 2*time.Second)
}
