package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// outcome is the decision about one log message, before it is delivered
// and saved.
type outcome struct {
	m       *logMsg
	d       sink.Decision
	report  bool
	deliver bool
	term    bool

	ctx  context.Context // carries the message's span, when it has one
	span trace.Span
}

// handle decides a batch in log order, delivers the accepted effects,
// saves the progress, and only then acks.
func (r *Runner) handle(ctx context.Context, msgs []*logMsg) error {
	began := time.Now()
	sort.Slice(msgs, func(i, j int) bool { return msgs[i].seq < msgs[j].seq })
	r.mu.Lock()
	work, rev := r.st.clone(), r.rev
	r.mu.Unlock()
	start := work.Seq
	var outs []outcome
	var handled []jetstream.Msg // at or below the saved position: ack only
	var stopErr error
	rest := len(msgs)
	for i, m := range msgs {
		if m.seq <= work.Seq {
			handled = append(handled, m.msg)
			continue
		}
		if m.seq > work.Seq+1 {
			// Something between the saved position and this message
			// was delivered earlier (to a runner that died) or not at
			// all: read it from the log, in order.
			if stopErr = r.fill(ctx, &work, m.seq, &outs); stopErr != nil {
				rest = i
				break
			}
		}
		o, err := r.decide(ctx, &work, m)
		if err != nil {
			stopErr, rest = err, i
			break
		}
		outs = append(outs, o)
		work.Seq = m.seq
	}
	for _, m := range msgs[rest:] {
		if m.msg != nil && m.seq > work.Seq {
			_ = m.msg.NakWithDelay(time.Second)
		}
	}
	if work.Seq > start {
		r.startSpans(ctx, outs, began)
		err := r.settle(ctx, outs, work, rev)
		endSpans(outs, err)
		if err != nil {
			return err
		}
		for _, o := range outs {
			if o.m.msg == nil {
				continue
			}
			if o.term {
				_ = o.m.msg.TermWithReason(o.d.Outcome.String())
			} else {
				_ = o.m.msg.Ack()
			}
		}
	}
	for _, m := range handled {
		if m != nil {
			_ = m.Ack()
		}
	}
	return stopErr
}

// settle delivers a decided batch, saves the progress and reports the
// decisions.
func (r *Runner) settle(ctx context.Context, outs []outcome, work state, rev uint64) error {
	if err := r.deliver(ctx, outs); err != nil {
		return err
	}
	if err := r.at("delivered"); err != nil {
		return err
	}
	saved, nrev, err := r.save(ctx, work, rev)
	if err != nil {
		return err
	}
	if err := r.at("saved"); err != nil {
		return err
	}
	for _, o := range outs {
		if o.report {
			r.rep.Report(o.ctx, o.d)
		}
	}
	// Waiters on the position see the decisions reported.
	r.adopt(saved, nrev)
	return nil
}

// startSpans starts the span of each message whose decision is reported:
// it covers the batch from its first decision to the saved outcome, and
// the Handler or the republish runs under it.
func (r *Runner) startSpans(ctx context.Context, outs []outcome, began time.Time) {
	for i := range outs {
		o := &outs[i]
		o.ctx = ctx
		if !o.report {
			continue
		}
		o.ctx, o.span = r.rep.StartProcess(ctx, telemetry.HeaderCarrier(o.m.header), o.m.subject, o.d.Stamp, trace.WithTimestamp(began))
		if o.span.IsRecording() {
			o.span.SetAttributes(telemetry.AttrPosition.Int64(int64(o.m.seq)))
			if o.d.Outcome == sink.Advanced {
				o.span.SetAttributes(telemetry.AttrBarrier.Bool(true))
			}
		}
	}
}

// endSpans ends the messages' spans; err means the batch was not saved and
// is decided again later.
func endSpans(outs []outcome, err error) {
	for i := range outs {
		if s := outs[i].span; s != nil {
			if err != nil {
				s.SetStatus(codes.Error, "not saved, to be decided again: "+err.Error())
			}
			s.End()
		}
	}
}

// at runs the test hook at a named point.
func (r *Runner) at(point string) error {
	if r.hook == nil {
		return nil
	}
	if err := r.hook(point); err != nil {
		return fmt.Errorf("%w at %s: %w", errStop, point, err)
	}
	return nil
}

// fill decides the log messages after work.Seq and before upto, read from
// the stream.
func (r *Runner) fill(ctx context.Context, work *state, upto uint64, outs *[]outcome) error {
	for {
		m, err := r.next(ctx, work.Seq+1)
		if err != nil {
			return err
		}
		if m == nil || m.seq >= upto {
			return nil
		}
		o, err := r.decide(ctx, work, m)
		if err != nil {
			return err
		}
		*outs = append(*outs, o)
		work.Seq = m.seq
	}
}

// decide judges one log message against work's fences and updates them.
// An error means the decision could not be taken (the lease bucket did not
// answer); the message is decided again later.
func (r *Runner) decide(ctx context.Context, work *state, m *logMsg) (outcome, error) {
	o := outcome{m: m, report: true}
	st, err := leasehold.StampFromHeader(m.header)
	if err != nil {
		o.term = true
		o.d = sink.Decision{Outcome: sink.BadStamp, Stamp: st, Subject: m.subject, Position: m.seq,
			Err: fmt.Errorf("streamsink: %s at log position %d (subject %s): %w", r.cfg.Stream, m.seq, m.subject, err)}
		return o, nil
	}
	_, barrier := headerGet(m.header, leasehold.HeaderBarrier)
	f := work.Fences[st.Partition]
	o.d = sink.Decision{Stamp: st, Subject: m.subject, Position: m.seq, Max: f.Epoch, Holder: f.Holder}
	if st.Epoch < f.Epoch {
		if barrier {
			// A late barrier of an earlier acquisition moves nothing.
			o.report = false
			return o, nil
		}
		o.term = true
		o.d.Outcome = sink.Stale
		o.d.Err = sink.StaleError(st, f.Epoch, f.Holder)
		return o, nil
	}
	if st.Epoch > f.Epoch {
		// The verifier may be the user's: bound it, or one unanswered
		// request stops the runner for good.
		cctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
		err := r.check.Check(cctx, st)
		cancel()
		if err != nil {
			if !errors.Is(err, sink.ErrUnverifiedEpoch) {
				return outcome{}, err
			}
			o.term = true
			o.d.Outcome, o.d.Err = sink.Unverified, err
			return o, nil
		}
		work.Fences[st.Partition] = fenceInfo{Epoch: st.Epoch, Holder: st.Worker}
	}
	o.d.Max = st.Epoch
	if barrier {
		o.d.Outcome = sink.Advanced
		o.report = st.Epoch > f.Epoch
		return o, nil
	}
	o.d.Outcome = sink.Accepted
	o.deliver = true
	return o, nil
}

// deliver republishes, or hands over, the accepted effects in log order,
// retrying until they are delivered or ctx ends.
func (r *Runner) deliver(ctx context.Context, outs []outcome) error {
	if r.cfg.BatchHandler != nil {
		var effects []sink.Effect
		for i := range outs {
			if o := &outs[i]; o.deliver {
				effects = append(effects, sink.Effect{Stamp: o.d.Stamp, Subject: o.m.subject, Data: o.m.data, Header: o.m.header})
			}
		}
		if len(effects) == 0 {
			return nil
		}
		for attempt := 0; ; attempt++ {
			err := r.cfg.BatchHandler(ctx, effects)
			if err == nil {
				return nil
			}
			if err := r.backoff(ctx, attempt, "batch handler", err); err != nil {
				return err
			}
		}
	}
	if r.cfg.Handler != nil {
		for i := range outs {
			o := &outs[i]
			if !o.deliver {
				continue
			}
			e := sink.Effect{Stamp: o.d.Stamp, Subject: o.m.subject, Data: o.m.data, Header: o.m.header}
			for attempt := 0; ; attempt++ {
				err := r.cfg.Handler(o.ctx, e)
				if err == nil {
					break
				}
				if err := r.backoff(ctx, attempt, "handler", err); err != nil {
					return err
				}
			}
		}
		return nil
	}
	todo := make([]int, 0, len(outs))
	for i := range outs {
		if outs[i].deliver {
			todo = append(todo, i)
		}
	}
	for attempt := 0; len(todo) > 0; attempt++ {
		futures := make([]jetstream.PubAckFuture, len(todo))
		var failed []int
		var lastErr error
		for j, i := range todo {
			f, err := r.js.PublishMsgAsync(r.republished(outs[i].ctx, outs[i].m, outs[i].d.Stamp))
			if err != nil {
				failed, lastErr = append(failed, i), err
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
				failed, lastErr = append(failed, i), err
			case <-timeout:
				for _, k := range todo[j:] {
					failed = append(failed, k)
				}
				lastErr = errors.New("no acknowledgement from the downstream stream")
				break wait
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		todo = failed
		if len(todo) > 0 {
			if err := r.backoff(ctx, attempt, "republish", lastErr); err != nil {
				return err
			}
		}
	}
	return nil
}

// republished builds the downstream message for an accepted effect: its
// headers (the stamp included), the trace context of the span that
// decided it, and the idempotency key as Nats-Msg-Id so that the server
// drops a repeat.
func (r *Runner) republished(ctx context.Context, m *logMsg, st leasehold.Stamp) *nats.Msg {
	out := nats.NewMsg(r.cfg.Subject(m.subject))
	for k, vs := range m.header {
		if strings.HasPrefix(strings.ToLower(k), "nats-") {
			continue
		}
		out.Header[k] = vs
	}
	r.rep.Telemetry().Propagator.Inject(ctx, telemetry.HeaderCarrier(out.Header))
	out.Header.Set(jetstream.MsgIDHeader, st.Key)
	out.Data = m.data
	return out
}

// save writes work's progress over revision rev, retrying while NATS is
// away. A refusal whose saved state is not ours means another runner.
func (r *Runner) save(ctx context.Context, work state, rev uint64) (state, uint64, error) {
	for attempt := 0; ; attempt++ {
		nrev, err := r.saveState(ctx, work, rev)
		if err == nil {
			return work, nrev, nil
		}
		if isStateConflict(err) {
			// An earlier attempt whose answer was lost may have landed.
			cur, crev, lerr := r.loadState(ctx)
			if lerr == nil && cur.Seq == work.Seq {
				return cur, crev, nil
			}
			if lerr == nil {
				return state{}, 0, fmt.Errorf("%w: consumer %s: saved position %d, ours %d", ErrStateConflict, r.cfg.Consumer, cur.Seq, work.Seq)
			}
			err = lerr
		}
		if err := r.backoff(ctx, attempt, "save progress", err); err != nil {
			return state{}, 0, err
		}
	}
}

func (r *Runner) adopt(s state, rev uint64) {
	r.mu.Lock()
	r.st, r.rev = s, rev
	close(r.progress)
	r.progress = make(chan struct{})
	r.mu.Unlock()
}

func (r *Runner) backoff(ctx context.Context, attempt int, what string, err error) error {
	wait := min(r.cfg.MaxBackoff, 10*time.Millisecond<<min(attempt, 10))
	r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: retrying", slog.String("sink", r.cfg.Name),
		slog.String("step", what), slog.Int("attempt", attempt+1), slog.Duration("wait", wait), slog.Any("error", err))
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(wait):
		return nil
	}
}
