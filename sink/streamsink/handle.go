package streamsink

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/nats-io/nats.go"
)

// outcome is the decision about one log message, before it is delivered
// and saved.
type outcome struct {
	m       *logMsg
	d       sink.Decision
	report  bool
	deliver bool
	term    bool
	job     uint64 // the job of an effect handed on as part of its job (see groups.go)
	refile  error  // the refusal of a replayed dead letter, which goes back (see refile.go)

	ctx  context.Context // carries the message's span, when it has one
	span trace.Span
}

// handle decides a batch in log order, delivers the accepted effects,
// saves the progress, and only then acks.
func (r *Runner) handle(ctx context.Context, msgs []*logMsg) error {
	began := time.Now()
	slices.SortFunc(msgs, func(a, b *logMsg) int { return cmp.Compare(a.seq, b.seq) })
	// Only this goroutine changes the position and the fence table, so it
	// reads them without the lock.
	w := &work{seq: r.seq}
	start := w.seq
	// An outcome is large: the batch's are made room for at once, and
	// walked in place, in room kept from batch to batch.
	outs := r.outs[:0]
	if cap(outs) < len(msgs) {
		outs = make([]outcome, 0, max(len(msgs), min(r.cfg.Batch, maxKeptOuts)))
	}
	defer func() { r.keepOuts(outs) }()
	var handled []*nats.Msg // at or below the saved position: ack only
	var stopErr error
	rest := len(msgs)
	for i, m := range msgs {
		if m.seq <= w.seq {
			handled = append(handled, m.msg)
			continue
		}
		if m.seq > w.seq+1 {
			// Something between the saved position and this message
			// was delivered earlier (to a runner that died) or not at
			// all: read it from the log, in order.
			if stopErr = r.fill(ctx, w, m.seq, &outs); stopErr != nil {
				rest = i
				break
			}
			if m.seq > w.seq+1 {
				if stopErr = r.checkGap(ctx, w.seq+1, m.seq-1); stopErr != nil {
					rest = i
					break
				}
			}
		}
		if err := r.decideLog(ctx, w, m, &outs); err != nil {
			stopErr, rest = err, i
			break
		}
		w.seq = m.seq
	}
	if r.applyProofs(w.seq, &outs) {
		w.grouped = true
	}
	for _, m := range msgs[rest:] {
		if m.msg != nil && m.seq > w.seq {
			_ = m.msg.NakWithDelay(time.Second)
		}
	}
	// A batch that decided nothing new (redeliveries of messages already
	// decided, or a first message whose decision failed) may still have
	// changed the groups: a round of records applied at it, or a rise
	// that abandoned a lease's groups. What it applied and dropped is
	// delivered, reported and saved like any batch's: left undone, the
	// chains would hold the jobs applied and the saved position pass
	// them, and they would be lost.
	if w.seq > start || w.grouped {
		r.startSpans(ctx, outs, began)
		err := r.settle(ctx, outs, w)
		endSpans(outs, err)
		if err != nil {
			if w.grouped || len(r.groups.open) > 0 {
				// The groups hold what this batch placed in them: the
				// saved state is made the runner's again, and the log
				// read from its position.
				r.needReload = true
			}
			return err
		}
		for i := range outs {
			o := &outs[i]
			if o.m.msg == nil {
				continue
			}
			if o.term {
				_ = o.m.msg.Respond([]byte("+TERM " + o.d.Outcome.String()))
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

// keepOuts keeps the room of a batch's outcomes for the next batch,
// emptied: nothing of a handled batch stays reachable from it. Room for
// more than maxKeptOuts goes.
func (r *Runner) keepOuts(outs []outcome) {
	clear(outs)
	if cap(outs) > maxKeptOuts {
		outs = nil
	}
	r.outs = outs[:0]
}

// maxKeptOuts bounds the outcomes keepOuts keeps room for. An effect
// handed on with its job takes two, so a batch of the default 400 packed
// messages of three effects takes 2400; room dropped after each batch
// would be grown again, copy by copy, in the next. The room kept is what
// the largest batch took, up to about 1.1 MB (an outcome is 272 B).
const maxKeptOuts = 4096

// settle delivers a decided batch, reports the decisions and saves the
// progress.
//
// The decisions are reported before the save: once the position is saved,
// a runner that takes over after a crash acks the batch's messages without
// deciding them, and a refusal reported only after the save would be lost
// with the process. Reported first, a crash before the save reports them
// again when the batch is decided again (at least once, never none). A save
// that fails is not a crash: the runner keeps what it reported (unsaved)
// and does not report the same decision twice itself.
func (r *Runner) settle(ctx context.Context, outs []outcome, w *work) error {
	if err := r.groups.overflow; err != nil {
		// Nothing of the batch is delivered: it is decided again from the
		// saved position, and stops here again, until the worker's window
		// is within the bound.
		return err
	}
	if err := r.refileAll(ctx, outs); err != nil {
		return err
	}
	if err := r.deliver(ctx, outs); err != nil {
		return err
	}
	r.notDelivered(ctx, outs)
	if err := r.at("delivered"); err != nil {
		return err
	}
	for i := range outs {
		// Looked up only after a failed save: an outcome is large to copy.
		if o := &outs[i]; o.report && (len(r.unsaved) == 0 || !r.reportedBefore(*o)) {
			r.rep.Report(o.ctx, o.d)
		}
	}
	written, err := r.save(ctx, w)
	if err != nil {
		r.keepReported(outs)
		return err
	}
	clear(r.unsaved)
	if err := r.at("saved"); err != nil {
		return err
	}
	// Waiters on the position see the decisions reported.
	r.adopt(w, written)
	return nil
}

// notDelivered records, for each job an effect of which went to the
// dead-letter stream instead of its destination, that the job was not
// applied: a job counts as applied once its effects were delivered, and
// one that was not stays open for its dead letters (see applied.hole).
func (r *Runner) notDelivered(ctx context.Context, outs []outcome) {
	for i := range outs {
		o := &outs[i]
		if o.job == 0 || o.d.Outcome != sink.DeadLettered {
			continue
		}
		st := o.d.Stamp
		k := groupKey{chainKey: chainKey{fence: st.Fence(), subject: o.m.subject}, epoch: st.Epoch, acquisition: st.Acquisition, job: o.job}
		if forgot := r.groups.addHole(k); forgot != 0 {
			r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: forgot a dead-lettered job: its dead letters, replayed with their job headers, are taken for duplicates; replay them without (no Leasehold-Job)",
				slog.String("sink", r.cfg.Name), slog.String("fence", st.Fence().String()), slog.String("subject", o.m.subject), slog.Uint64("job", forgot))
		}
	}
}

// reported is a decision reported for an effect at a log position: a
// packed message (leasehold.HeaderPack) holds several, told apart by
// their keys.
type reported struct {
	key     string
	outcome sink.Outcome
}

// reportedBefore reports whether this runner reported o's decision for
// its effect already, in a batch whose save failed.
func (r *Runner) reportedBefore(o outcome) bool {
	if len(r.unsaved) == 0 {
		return false
	}
	for _, d := range r.unsaved[o.m.seq] {
		if d.key == o.d.Stamp.Key {
			return d.outcome == o.d.Outcome
		}
	}
	return false
}

// keepReported records the decisions of a batch whose save failed, which
// were reported: the batch is decided again, from the saved position. The
// record holds no more than the messages above that position.
func (r *Runner) keepReported(outs []outcome) {
	if r.unsaved == nil {
		r.unsaved = map[uint64][]reported{}
	}
	for i := range outs {
		if o := &outs[i]; o.report {
			r.keepOne(o)
		}
	}
	for seq := range r.unsaved {
		if seq <= r.saved {
			delete(r.unsaved, seq)
		}
	}
}

// startSpans starts the span of each message whose decision is reported:
// it covers the batch from its first decision to the saved outcome, and
// the Handler or the republish runs under it.
func (r *Runner) startSpans(ctx context.Context, outs []outcome, began time.Time) {
	// One start option for the batch: built per message, it cost two
	// allocations each, spans recorded or not. The room beyond it takes
	// the options the Reporter appends to it (its processOpts), which
	// cost another allocation per message where the slice was full.
	// Written over by each call with the same options: the spans are
	// started one at a time, and none keeps the slice.
	start := make([]trace.SpanStartOption, 1, 4)
	start[0] = trace.WithTimestamp(began)
	for i := range outs {
		o := &outs[i]
		o.ctx = ctx
		if !o.report {
			continue
		}
		// The message's position in the log goes only on the spans of
		// messages that were not simply applied: an accepted write is
		// found by its key.
		var extra []attribute.KeyValue
		switch o.d.Outcome {
		case sink.Accepted, sink.Duplicate:
		case sink.Advanced:
			extra = []attribute.KeyValue{telemetry.AttrPosition.Int64(int64(o.m.seq)), telemetry.AttrBarrier.Bool(true)}
		default:
			extra = []attribute.KeyValue{telemetry.AttrPosition.Int64(int64(o.m.seq))}
		}
		o.ctx, o.span = r.rep.StartProcessWith(ctx, telemetry.HeaderCarrier(o.m.header), o.m.subject, o.d.Stamp, extra, start...)
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

// fill decides the log messages after w.seq and before upto, read from
// the stream.
func (r *Runner) fill(ctx context.Context, w *work, upto uint64, outs *[]outcome) error {
	for {
		m, err := r.next(ctx, w.seq+1)
		if err != nil {
			return err
		}
		if m == nil || m.seq >= upto {
			return nil
		}
		if m.seq > w.seq+1 {
			if err := r.checkGap(ctx, w.seq+1, m.seq-1); err != nil {
				return err
			}
		}
		if err := r.decideLog(ctx, w, m, outs); err != nil {
			return err
		}
		w.seq = m.seq
	}
}

// decide judges one log message against the fences as they stand at its
// position (w's, since messages are decided in log order) and records a
// rise. An error means the decision could not be taken (the lease bucket
// did not answer); the message is decided again later.
//
// An effect of a job is placed in its group (see groups.go); what becomes
// of the group's effects, applied or dropped, is appended to outs.
func (r *Runner) decide(ctx context.Context, w *work, m *logMsg, outs *[]outcome) (outcome, error) {
	st, err := leasehold.StampFromHeader(m.header)
	if err != nil {
		return r.badStamp(m, st, err), nil
	}
	_, barrier := headerGet(m.header, leasehold.HeaderBarrier)
	return r.decideStamped(ctx, w, m, st, barrier, nil, outs)
}

// badStamp is the outcome of a message whose stamp, job mark or packed
// effects (see packed.go) are malformed: terminated and reported.
func (r *Runner) badStamp(m *logMsg, st leasehold.Stamp, err error) outcome {
	return outcome{m: m, report: true, term: true, d: sink.Decision{Outcome: sink.BadStamp, Stamp: st, Subject: m.subject, Position: m.seq,
		Err: fmt.Errorf("streamsink: %s at log position %d (subject %s): %w", r.cfg.Stream, m.seq, m.subject, err)}}
}

// decideStamped is decide for a message whose stamp st was read: a
// barrier, or an effect whose job mark is known (an effect of a packed
// message) or, when known is nil, read from its headers.
func (r *Runner) decideStamped(ctx context.Context, w *work, m *logMsg, st leasehold.Stamp, barrier bool, known *leasehold.JobMark, outs *[]outcome) (outcome, error) {
	o := outcome{m: m, report: true}
	id := st.Fence()
	cur, exists := w.fence(r.fences, id)
	f := cur.state()
	o.d = sink.Decision{Stamp: st, Subject: m.subject, Position: m.seq, Max: f.Epoch, MaxAcquisition: f.Acquisition, Holder: f.Holder}
	v, raise := leasehold.Judge(f, st)
	if v != leasehold.Admit {
		if barrier && v == leasehold.Stale {
			// A late barrier of an earlier acquisition moves nothing.
			o.report = false
			return o, nil
		}
		o.term = true
		o.d.Outcome = sink.Refused(v)
		o.d.Err = leasehold.Refusal(f, st, v)
		if !barrier && replayed(m.header) {
			o.refile = o.d.Err
		}
		return o, nil
	}
	if raise {
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
		if !exists {
			if err := w.room(r.fences, id, st.Key, r.cfg.MaxFences); err != nil {
				o.term = true
				o.d.Outcome, o.d.Err = outcomeFenceLimit, err
				return o, nil
			}
		}
		w.raise(r.fences, id, rise{At: m.seq, Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: holderOf(st.Worker)})
		if len(r.groups.open) > 0 {
			w.grouped = true
			r.abandon(id, st.Epoch, st.Acquisition, m.seq, outs)
		}
	}
	o.d.Max, o.d.MaxAcquisition = st.Epoch, st.Acquisition
	if raise {
		o.d.Holder = holderOf(st.Worker)
	}
	if barrier {
		o.d.Outcome = sink.Advanced
		o.report = raise
		return o, nil
	}
	o.d.Outcome = sink.Accepted
	o.deliver = true
	var mark leasehold.JobMark
	var err error
	if known != nil {
		mark = *known
	} else if mark, err = leasehold.JobMarkFromHeader(m.header); err != nil {
		o.term, o.deliver = true, false
		o.d.Outcome = sink.BadStamp
		o.d.Err = fmt.Errorf("streamsink: %s at log position %d (subject %s): %w", r.cfg.Stream, m.seq, m.subject, err)
		return o, nil
	}
	if !mark.Standalone() {
		w.grouped = true
		if err := r.decideJob(&o, mark, outs); err != nil {
			return outcome{}, err
		}
	}
	return o, nil
}

// outcomeFenceLimit is the outcome of an effect refused by ErrFenceLimit.
const outcomeFenceLimit = sink.OverLimit

// save writes w: first the fence shards it changes (and any the saved
// state holds ahead of the saved position), then its position, retrying
// while NATS is away. It returns the shards it wrote. A write refused
// because the key moved, and not by an earlier attempt of ours, means
// another runner.
func (r *Runner) save(ctx context.Context, w *work) ([]int, error) {
	// The saved position stops short of the first effect of a job still
	// open: a runner that starts from it finds the job's effects again.
	pos := w.seq
	if first := r.groups.firstOpen(); first != 0 && first-1 < pos {
		pos = first - 1
	}
	pos = max(pos, r.saved)
	shards := w.dirty(r.fences)
	todo := make(map[int][]byte, len(shards))
	for _, k := range shards {
		body := encodeShard(w.history(r.fences, k, pos))
		if len(body) > shardBytes {
			// reserve and room keep this from happening.
			return nil, fmt.Errorf("streamsink: fence shard %d would take %d bytes, above its bound of %d", k, len(body), shardBytes)
		}
		todo[k] = body
	}
	for attempt := 0; ; attempt++ {
		err := r.saveShards(ctx, r.fences, todo)
		if err == nil && len(shards) > 0 {
			if err = r.at("fenced"); err != nil {
				return nil, err
			}
		}
		if err == nil {
			err = r.checkpointApplied(ctx)
		}
		if err == nil {
			var nrev uint64
			if nrev, err = r.savePosition(ctx, pos, r.rev); err == nil {
				r.rev = nrev
				r.saved = pos
				return shards, nil
			}
		}
		if errors.Is(err, ErrStateConflict) {
			return nil, err
		}
		if err := r.backoff(ctx, attempt, "save progress", err); err != nil {
			return nil, err
		}
	}
}

// adopt makes w, saved, the runner's state.
func (r *Runner) adopt(w *work, written []int) {
	r.forgetTries(w.seq)
	r.mu.Lock()
	r.seq = w.seq
	r.fences.commit(w, written, r.saved)
	r.heldCount, r.aboveCount = r.groups.held, r.groups.above
	if len(r.groups.open) == 0 {
		r.stuckCount = 0
	}
	forgot := r.groups.forgot
	r.forgotten += int64(forgot)
	r.groups.forgot = 0
	close(r.progress)
	r.progress = make(chan struct{})
	r.mu.Unlock()
	if forgot > 0 && time.Since(r.forgotLogged) >= 10*time.Second {
		r.forgotLogged = time.Now()
		r.log.Warn("streamsink: chains hold as many jobs applied above their floors as they may, and forget the lowest: their effects, should they come again, apply again; committed progress lags, or cannot be read",
			"sink", r.cfg.Name, "forgotten", forgot, "max_above_floor", maxAbove)
	}
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

// keepOne records o's decision, reported: the latest for its effect.
func (r *Runner) keepOne(o *outcome) {
	ds := r.unsaved[o.m.seq]
	for i := range ds {
		if ds[i].key == o.d.Stamp.Key {
			ds[i].outcome = o.d.Outcome
			return
		}
	}
	r.unsaved[o.m.seq] = append(ds, reported{key: o.d.Stamp.Key, outcome: o.d.Outcome})
}
