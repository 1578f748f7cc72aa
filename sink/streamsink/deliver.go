package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// Accepted effects are delivered in log order: republished into the
// downstream stream, or handed to the Handler or the BatchHandler, each
// retried until it is delivered, moved to the dead-letter stream
// (deadletter.go) or the runner stops.

// deliver republishes, or hands over, the accepted effects in log order,
// retrying each until it is delivered, it is moved to the dead-letter
// stream (see Config.MaxDeliveries), or ctx ends.
func (r *Runner) deliver(ctx context.Context, outs []outcome) error {
	for i := range outs {
		if o := &outs[i]; o.deliver && len(r.tries) > 0 && r.tries[o.at()] == deadLettered {
			// Moved by an earlier try of this batch, whose progress was
			// not saved: marked so, not moved again.
			if err := r.deadLetter(ctx, o, r.cfg.MaxDeliveries, errors.New("dead-lettered before the progress was saved")); err != nil {
				return err
			}
		}
	}
	switch {
	case r.cfg.BatchHandler != nil:
		return r.deliverBatch(ctx, outs)
	case r.cfg.Handler != nil:
		return r.deliverEach(ctx, outs, "handler", func(o *outcome) error { return r.cfg.Handler(o.ctx, effectOf(o)) })
	}
	return r.republish(ctx, outs)
}

// natsAway reports whether a delivery failed because NATS, or the
// destination, could not serve it for now (the connection is down, no
// responders, a timeout, JetStream not ready; an error marked
// sink.ErrUnavailable): a failure that is not the effect's, so it does
// not count towards dead-lettering it. A NATS or database restart must not
// move effects to the dead-letter stream; a runner held up for long shows
// in Ready.
func (r *Runner) natsAway(err error) bool {
	return !r.js.Conn().IsConnected() || retry.Transient(err) || errors.Is(err, sink.ErrUnavailable)
}

func effectOf(o *outcome) sink.Effect {
	return sink.Effect{Stamp: o.d.Stamp, Subject: o.m.subject, Data: o.m.data, Header: o.m.header}
}

// deliverBatch hands the accepted effects to the BatchHandler, in calls
// of at most HandlerBatch effects each that never split a job's effects
// on a subject: a job whose effects are more than HandlerBatch comes in a
// call of its own, so that a destination that writes one call atomically
// applies each job whole. A call's error fails the whole call without
// saying which effect failed, so after one failure the effects of that
// call and those after it are handed over one by one, each call a batch
// of one: the handler's errors are then each effect's own, and only an
// effect that fails MaxDeliveries times is dead-lettered. A failure that
// is NATS's own blames no effect: the call is tried again whole.
func (r *Runner) deliverBatch(ctx context.Context, outs []outcome) error {
	n := 0
	for i := range outs {
		if outs[i].deliver {
			n++
		}
	}
	// Made to size: grown by appends, a batch's effects would be copied
	// over and over. They are made anew for each batch, since a handler
	// may keep what it was handed.
	effects := make([]sink.Effect, 0, n)
	at := make([]int, 0, n) // the index in outs of each of effects
	for i := range outs {
		if o := &outs[i]; o.deliver {
			effects = append(effects, effectOf(o))
			at = append(at, i)
		}
	}
	for from := 0; from < len(effects); {
		to := r.handlerCall(outs, at, from)
		call := effects[from:to]
		for attempt := 0; ; attempt++ {
			err := r.cfg.BatchHandler(ctx, call)
			if err == nil {
				for _, i := range at[from:to] {
					r.delivered(outs[i].at())
				}
				break
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if len(call) == 1 || !r.natsAway(err) {
				if len(call) > 1 {
					r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: the batch handler failed; handing the batch's effects over one by one to find the one that fails",
						slog.String("sink", r.cfg.Name), slog.Int("effects", len(call)), slog.Any("error", err))
				}
				// The calls before this one were delivered.
				return r.deliverEach(ctx, outs[at[from]:], "batch handler", func(o *outcome) error {
					return r.cfg.BatchHandler(o.ctx, []sink.Effect{effectOf(o)})
				})
			}
			// NATS is away: no effect is to blame, and the call is tried
			// again whole.
			if err := r.backoff(ctx, attempt, "batch handler", err); err != nil {
				return err
			}
		}
		from = to
	}
	return nil
}

// handlerCall returns the end (in at) of the BatchHandler call that begins
// with the effect at[from]: as many whole jobs' effects as HandlerBatch
// allows, and at least the first job's, however many. A job's effects on
// a subject are handed on together, one after another (see Runner.apply);
// an effect of no job is a unit of its own.
func (r *Runner) handlerCall(outs []outcome, at []int, from int) int {
	to := from
	for to < len(at) {
		end := to + 1
		for end < len(at) && sameJob(&outs[at[end-1]], &outs[at[end]]) {
			end++
		}
		if to > from && end-from > r.cfg.HandlerBatch {
			break
		}
		to = end
		if to-from >= r.cfg.HandlerBatch {
			break
		}
	}
	return to
}

// sameJob reports whether a and b are effects of one job's group: one job
// of one lease on one fence and subject.
func sameJob(a, b *outcome) bool {
	if a.job == 0 || a.job != b.job || a.m.subject != b.m.subject {
		return false
	}
	sa, sb := a.d.Stamp, b.d.Stamp
	return sa.Fence() == sb.Fence() && sa.Epoch == sb.Epoch && sa.Acquisition == sb.Acquisition
}

// deliverEach hands the accepted effects over one at a time with apply,
// in log order.
func (r *Runner) deliverEach(ctx context.Context, outs []outcome, what string, apply func(*outcome) error) error {
	for i := range outs {
		o := &outs[i]
		if !o.deliver {
			continue
		}
		for attempt := 0; ; attempt++ {
			err := apply(o)
			if err == nil {
				r.delivered(o.at())
				break
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			n := r.tries[o.at()]
			if !r.natsAway(err) {
				n = r.failed(o.at())
			}
			if n >= r.cfg.MaxDeliveries || errors.Is(err, ErrPoison) {
				if err := r.deadLetter(ctx, o, n, err); err != nil {
					return err
				}
				break
			}
			if err := r.backoff(ctx, attempt, what, err); err != nil {
				return err
			}
		}
	}
	return nil
}

// republish publishes the accepted effects into the downstream stream, all
// at once, and retries those that fail. With Config.AtomicJobs a job's
// effects on a subject, delivered together, go in one atomic batch (see
// republishJobs): a reader of that stream sees all of them or none.
func (r *Runner) republish(ctx context.Context, outs []outcome) error {
	todo := make([]int, 0, len(outs))
	for i := range outs {
		if outs[i].deliver {
			todo = append(todo, i)
		}
	}
	for attempt := 0; len(todo) > 0; attempt++ {
		futures := make([]jetstream.PubAckFuture, len(todo))
		errs := make(map[int]error)
		alone := r.republishJobs(ctx, outs, todo, errs)
		made := newOutMsgs(outs, todo, alone)
		for j, i := range todo {
			if !alone[j] {
				continue // in a batch: stored, or failed in errs
			}
			msg, id := made.next()
			r.fillRepublished(outs[i].ctx, msg, outs[i].m, outs[i].d.Stamp, id)
			f, err := r.js.PublishMsgAsync(msg)
			if err != nil {
				errs[i] = err
				continue
			}
			futures[j] = f
		}
		timeout := time.After(r.cfg.RequestTimeout)
	wait:
		for j, i := range todo {
			f := futures[j]
			if f == nil {
				continue
			}
			select {
			case ack := <-f.Ok():
				if ack.Duplicate {
					outs[i].d.Outcome = sink.Duplicate
				}
			case err := <-f.Err():
				errs[i] = err
			case <-timeout:
				for _, k := range todo[j:] {
					errs[k] = fmt.Errorf("no acknowledgement from the downstream stream within %v: %w", r.cfg.RequestTimeout, nats.ErrTimeout)
				}
				break wait
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		var retry []int
		var lastErr error
		for _, i := range todo {
			o := &outs[i]
			err, failed := errs[i]
			if !failed {
				r.delivered(o.at())
				continue
			}
			if errors.Is(err, nats.ErrMaxPayload) || headerTooLarge(err) {
				// The sink's headers took the effect over the server's
				// max payload, or its headers over what a stream takes
				// (64 KiB; a packed effect's headers travel in the pack's
				// body, where the server does not look): no retry can
				// make it fit.
				if err := r.deadLetter(ctx, o, r.failed(o.at()), err); err != nil {
					return err
				}
				continue
			}
			if !r.natsAway(err) {
				if n := r.failed(o.at()); n >= r.cfg.MaxDeliveries {
					if err := r.deadLetter(ctx, o, n, err); err != nil {
						return err
					}
					continue
				}
			}
			retry, lastErr = append(retry, i), err
		}
		todo = retry
		if len(todo) > 0 {
			if err := r.backoff(ctx, attempt, "republish", lastErr); err != nil {
				return err
			}
		}
	}
	return nil
}

// maxAtomicBatch is the most messages a JetStream atomic batch holds
// (nats-server's default): a job of more effects on a subject is
// republished one effect at a time.
const maxAtomicBatch = 1000

// atomicInFlight bounds the atomic batches a runner has in flight at
// once, well below what a server takes per stream (50 by default).
const atomicInFlight = 16

// republishJobs publishes, with Config.AtomicJobs, each job group among
// the effects at todo (in outs) in one JetStream atomic batch: the effects
// of one job on one subject that are delivered together (sameJob), two or
// more. It reports, by position in todo, the effects left to publish one
// by one: all of them without AtomicJobs, and otherwise those of no group,
// of a group larger than a batch, or of a group whose batch the server
// refused for what the effects hold (a duplicate message ID, as when an
// earlier try whose answer was lost stored it; a payload or headers too
// large; a header batches do not take). One by one, the message IDs
// settle which were stored already, and a failing effect is dead-lettered
// alone. A batch that failed for NATS's reasons (no answer, the
// connection, a batch the server did not receive whole) puts its effects'
// error in errs: they are tried again, in a batch, with the rest of todo.
func (r *Runner) republishJobs(ctx context.Context, outs []outcome, todo []int, errs map[int]error) []bool {
	alone := make([]bool, len(todo))
	for j := range alone {
		alone[j] = true
	}
	if !r.atomicOut.Load() {
		return alone
	}
	type batch struct{ from, to int } // a group, todo[from:to]
	var batches []batch
	for from := 0; from < len(todo); {
		to := from + 1
		for to < len(todo) && sameJob(&outs[todo[to-1]], &outs[todo[to]]) {
			to++
		}
		if n := to - from; n > 1 && n <= maxAtomicBatch {
			batches = append(batches, batch{from, to})
		}
		from = to
	}
	if len(batches) == 0 {
		return alone
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var disabled bool
	slots := make(chan struct{}, atomicInFlight)
	for _, b := range batches {
		// Built here, one at a time: Config.Subject is the caller's, and
		// need not be safe to call from several goroutines.
		msgs := make([]*nats.Msg, 0, b.to-b.from)
		for _, i := range todo[b.from:b.to] {
			msgs = append(msgs, r.republished(outs[i].ctx, outs[i].m, outs[i].d.Stamp))
		}
		slots <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-slots; wg.Done() }()
			bctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
			_, err := jspub.Batch(bctx, r.js.Conn(), msgs)
			cancel()
			mu.Lock()
			defer mu.Unlock()
			var apiErr *jetstream.APIError
			isAPI := errors.As(err, &apiErr)
			switch {
			case err == nil:
				for j := b.from; j < b.to; j++ {
					alone[j] = false
				}
			case isAPI && (apiErr.ErrorCode == jsBatchIncomplete || apiErr.ErrorCode == jsBatchInflight) || isAPI && retry.Transient(err):
				// The server did not get the batch whole, holds too many,
				// or is electing: nothing was stored, no effect is to
				// blame, and the batch is tried again.
				for j := b.from; j < b.to; j++ {
					alone[j] = false
					errs[todo[j]] = fmt.Errorf("atomic batch of job %d: %w: %w", outs[todo[j]].job, sink.ErrUnavailable, err)
				}
			case isAPI:
				// Refused for what the effects hold, or batches are not
				// taken after all: one by one.
				if apiErr.ErrorCode == jsBatchDisabled {
					disabled = true
				}
			case errors.Is(err, nats.ErrMaxPayload):
				// One of them is too large for any message: one by one,
				// it alone is dead-lettered.
			default:
				// No answer, or the connection failed: the batch may have
				// been stored. Tried again, a batch that was is refused
				// as a duplicate, and its effects go one by one, each
				// found stored.
				for j := b.from; j < b.to; j++ {
					alone[j] = false
					errs[todo[j]] = fmt.Errorf("atomic batch of job %d: %w", outs[todo[j]].job, err)
				}
			}
		}()
	}
	wg.Wait()
	if disabled && r.atomicOut.CompareAndSwap(true, false) {
		r.log.LogAttrs(ctx, slog.LevelError, "streamsink: AtomicJobs: the downstream stream refused an atomic batch as disabled (its atomic publish was turned off): a job's effects now reach it one by one, and a reader may see part of a job until the rest arrives; allow atomic publish on it and restart the runner",
			slog.String("sink", r.cfg.Name), slog.String("stream", r.cfg.Downstream))
	}
	return alone
}

// JetStream's error codes for atomic batches that republishJobs tells
// apart.
const (
	jsBatchDisabled   jetstream.ErrorCode = 10174 // the stream does not allow atomic publish
	jsBatchIncomplete jetstream.ErrorCode = 10176 // messages of the batch were lost on the way
	jsBatchInflight   jetstream.ErrorCode = 10210 // too many batches in flight on the stream
)

// republished builds the downstream message for an accepted effect:
// leasehold's headers and W3C trace context (see keepHeader), the trace
// context of the span that decided it, and the scope and idempotency key
// as Nats-Msg-Id so that the server drops a repeat.
func (r *Runner) republished(ctx context.Context, m *logMsg, st leasehold.Stamp) *nats.Msg {
	out := &outMsg{}
	out.id[0] = MessageID(st)
	r.fillRepublished(ctx, &out.msg, m, st, out.id[:])
	return &out.msg
}

// outMsg is a downstream message and its Nats-Msg-Id value, made in one
// allocation.
type outMsg struct {
	msg nats.Msg
	id  [1]string
}

// fillRepublished builds in out the downstream message for an accepted
// effect (see republished), whose Nats-Msg-Id value is id, MessageID(st)
// alone.
func (r *Runner) fillRepublished(ctx context.Context, out *nats.Msg, m *logMsg, st leasehold.Stamp, id []string) {
	out.Subject = r.cfg.Subject(m.subject)
	// Room for the headers kept, the trace context and the message ID,
	// made at once rather than grown.
	out.Header = make(nats.Header, len(m.header)+2)
	canonical := true
	for k, vs := range m.header {
		switch {
		case isCanonicalStampHeader(k):
			out.Header[k] = vs
		case isStampHeader(k):
			canonical = false // written below, from the stamp
		case keepHeader(k):
			out.Header[k] = vs
		}
	}
	if !canonical {
		// The stamp was read, so every spelling of a header agrees; it is
		// written back under the names readers look up.
		st.SetHeader(out.Header)
	}
	r.rep.Telemetry().Propagator.Inject(ctx, telemetry.HeaderCarrier(out.Header))
	out.Header[jetstream.MsgIDHeader] = id
	out.Data = m.data
}

// outMsgs is the room for the messages a republish round publishes one
// by one, made for the round at once: the messages with their
// Nats-Msg-Id values, and the IDs' text, an allocation each for the
// round where each message took three.
type outMsgs []outMsg

// newOutMsgs makes room for the messages of the effects at todo (in
// outs) that alone marks, with their message IDs.
func newOutMsgs(outs []outcome, todo []int, alone []bool) outMsgs {
	n, size := 0, 0
	for j, i := range todo {
		if alone[j] {
			st := &outs[i].d.Stamp
			n, size = n+1, size+len(st.Scope)+1+len(st.Key)
		}
	}
	var b strings.Builder
	b.Grow(size)
	for j, i := range todo {
		if alone[j] {
			st := &outs[i].d.Stamp
			b.WriteString(st.Scope)
			b.WriteByte(' ')
			b.WriteString(st.Key)
		}
	}
	all, from := b.String(), 0
	made := make(outMsgs, n)
	k := 0
	for j, i := range todo {
		if alone[j] {
			st := &outs[i].d.Stamp
			to := from + len(st.Scope) + 1 + len(st.Key)
			made[k].id[0], from, k = all[from:to], to, k+1
		}
	}
	return made
}

// next returns the room for the next message and its Nats-Msg-Id value,
// in the order of newOutMsgs.
func (b *outMsgs) next() (*nats.Msg, []string) {
	o := &(*b)[0]
	*b = (*b)[1:]
	return &o.msg, o.id[:]
}

// MessageID is the Nats-Msg-Id of an effect stamped with s in the
// downstream stream: "<scope> <key>". Dedupe is per scope and key, and a
// scope holds no space.
func MessageID(s leasehold.Stamp) string { return s.Scope + " " + s.Key }
