package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// writeBarriers fences the partition against its previous holder before
// the first job: every Config.Fences sink is advanced to this epoch, and a
// barrier is published to every barrier subject. A sink that consumes such
// a subject in order raises the partition's fence when it reaches the
// barrier, so the previous holder's effects after it are refused even
// though they travel through the same log. It retries with backoff until
// everything is written, and gives up (returning false) when the lease is
// lost or the partition is revoked first (returning how it ended): a
// partition is not handled unfenced.
func (r *runner) writeBarriers() outcome {
	fences := r.w.cfg.Fences
	subjects := r.w.cfg.BarrierSubjects(r.p)
	stamp := r.info.Stamp(leasehold.BarrierKey(r.info.Scope, r.p, r.info.Epoch))
	ctx, span := r.startFence()
	for attempt := 1; ; attempt++ {
		err := r.barrierRound(ctx, &fences, &subjects, stamp)
		if err == nil {
			span.End()
			return 0
		}
		span.RecordError(err)
		if r.ctx.Err() != nil {
			endSpan(span, context.Cause(r.ctx))
			return outLost
		}
		if errors.Is(err, leasehold.ErrStaleEpoch) {
			// A sink has a later epoch (or this one from another
			// acquisition) for the partition: this lease is not the newest,
			// whatever the lease bucket says. Handling jobs under it would
			// only have every write refused.
			endSpan(span, err)
			r.log.Error("a sink's fence is above this lease's epoch: not handling the partition; if the lease bucket was re-created with lower epochs, re-create it with a floor above the sinks' (leasehold init --epoch-floor)", "err", err)
			return outStale
		}
		wait := min(50*time.Millisecond<<min(attempt-1, 6), 2*time.Second)
		r.log.Warn("writing the partition's barriers failed; retrying before handling any job", "attempt", attempt, "backoff", wait, "err", err)
		if out := r.sleep(wait, nil); out != 0 {
			endSpan(span, err)
			return out
		}
	}
}

// barrierRound writes what is left, removing what succeeded. ctx is r.ctx
// with the fence's span.
func (r *runner) barrierRound(ctx context.Context, fences *[]Fence, subjects *[]string, stamp leasehold.Stamp) error {
	timeout := r.w.cfg.EffectTimeout
	for len(*fences) > 0 {
		actx, cancel := context.WithTimeout(ctx, timeout)
		actx, span := r.startAdvance(actx, (*fences)[0])
		err := (*fences)[0].Advance(actx, r.info)
		cancel()
		endSpan(span, err)
		if err != nil {
			return fmt.Errorf("advance fence %T to epoch %d: %w", (*fences)[0], r.info.Epoch, err)
		}
		r.event(r.ctx, Event{Kind: EventBarrierWritten, Stamp: stamp, Subject: "fence"})
		*fences = (*fences)[1:]
	}
	for len(*subjects) > 0 {
		subject := (*subjects)[0]
		msg := &nats.Msg{Subject: subject, Header: nats.Header{leasehold.HeaderBarrier: []string{"1"}}}
		sctx, span := r.startSend(ctx, subject, stamp)
		span.SetAttributes(telemetry.AttrBarrier.Bool(true))
		r.stampHeader(sctx, msg.Header, stamp, newNonce())
		err := r.publishSync(sctx, msg, timeout)
		endSpan(span, err)
		if err != nil {
			return fmt.Errorf("publish barrier to %s: %w", subject, err)
		}
		r.event(r.ctx, Event{Kind: EventBarrierWritten, Stamp: stamp, Subject: subject})
		*subjects = (*subjects)[1:]
	}
	return nil
}
