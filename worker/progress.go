package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// A partition's progress moves in two steps. A job is handled when its
// handler returned and its effects were sent; it is finished when every
// one of those effects (or its dead letter) is acknowledged, and only
// finished jobs are committed. Handled jobs wait in a window, in order,
// so the next job need not wait for the previous job's acknowledgements;
// an effect that fails sends the partition back to its job.

// inflight is a handled job whose effects are not all acknowledged.
type inflight struct {
	seq   uint64
	runs  int // attempts run, for a re-run after a failed effect
	futs  []jetstream.PubAckFuture
	acked int // futs[:acked] are acknowledged
	sent  time.Time

	// For a rewind: what it changed in the runner's after map (see
	// output.go).
	undo []afterUndo
}

// reap moves the finished mark past jobs whose effects are all
// acknowledged. With block, it waits until the oldest outstanding job is
// settled. It returns the first job with a failed effect.
func (r *runner) reap(ctx context.Context, block bool) (uint64, error) {
	for len(r.window) > 0 {
		e := &r.window[0]
		for e.acked < len(e.futs) {
			err, settled := r.await(ctx, e, block)
			if !settled {
				return 0, nil
			}
			if err != nil {
				return e.seq, err
			}
			e.acked++
		}
		r.finished = e.seq
		if len(r.retries) > 0 {
			delete(r.retries, e.seq)
		}
		r.window[0] = inflight{}
		r.window = r.window[1:]
		block = false
	}
	return 0, nil
}

// await checks the next unacknowledged publish of e; with block it waits
// for it, at most until the effect timeout.
func (r *runner) await(ctx context.Context, e *inflight, block bool) (error, bool) {
	fut := e.futs[e.acked]
	select {
	case ack := <-fut.Ok():
		return r.stored(ctx, fut, ack), true
	case err := <-fut.Err():
		return &EffectError{Subject: fut.Msg().Subject, Key: fut.Msg().Header.Get(jetstream.MsgIDHeader), Err: err}, true
	default:
	}
	left := r.w.cfg.EffectTimeout - time.Since(e.sent)
	if left > 0 && !block {
		return nil, false
	}
	if left > 0 {
		t := time.NewTimer(left)
		defer t.Stop()
		select {
		case ack := <-fut.Ok():
			return r.stored(ctx, fut, ack), true
		case err := <-fut.Err():
			return &EffectError{Subject: fut.Msg().Subject, Key: fut.Msg().Header.Get(jetstream.MsgIDHeader), Err: err}, true
		case <-ctx.Done():
			return context.Cause(ctx), true
		case <-t.C:
		}
	}
	return &EffectError{Subject: fut.Msg().Subject, Key: fut.Msg().Header.Get(jetstream.MsgIDHeader),
		Err: fmt.Errorf("no acknowledgement within %v: %w", r.w.cfg.EffectTimeout, jetstream.ErrAsyncPublishTimeout)}, true
}

// stored confirms an acknowledged effect (see confirm.go); one that is
// stored closes its subject's breaker, if one is open.
func (r *runner) stored(ctx context.Context, fut jetstream.PubAckFuture, ack *jetstream.PubAck) error {
	err := r.confirm(ctx, fut.Msg(), ack)
	if err == nil {
		r.w.effectStored(fut.Msg().Subject)
	}
	return err
}

// rewind handles a failed effect of job seq: every job from seq on is read
// and run again (their effects keep their idempotency keys, so what was
// stored is not stored twice).
func (r *runner) rewind(seq uint64, err error) outcome {
	r.fetch.stop()
	st := r.retries[seq]
	if len(r.window) > 0 && r.window[0].seq == seq {
		st.runs = max(st.runs, r.window[0].runs)
	}
	if r.counts(&st, err) {
		st.failures++
		st.dead = st.dead || IsPermanent(err) || st.failures >= r.w.cfg.MaxAttempts
	}
	st.err = err
	r.retries[seq] = st
	// Let the other publishes settle, so the re-run starts from a quiet
	// state; their outcome no longer matters.
	// The failed publish is the head's next one; those before it were
	// acknowledged (and their outcome consumed).
	ctx, cancel := context.WithTimeout(r.ctx, r.w.cfg.EffectTimeout)
	for i := range r.window {
		from := r.window[i].acked
		if i == 0 {
			from++
		}
		for _, f := range r.window[i].futs[min(from, len(r.window[i].futs)):] {
			select {
			case <-f.Ok():
			case <-f.Err():
			case <-ctx.Done():
			}
		}
	}
	cancel()
	r.unwind()
	r.window = nil
	r.w.tel.Metrics.JobsFailed.Add(r.ctx, 1)
	wait := r.w.cfg.Backoff(max(st.runs, 1))
	r.event(r.ctx, Event{Kind: EventJobFailed, Seq: seq, Attempt: st.runs, Err: err, Backoff: wait})
	r.log.Warn("an effect was not stored; running the partition again from its job", "seq", seq, "backoff", wait, "err", err)
	if out := r.sleep(wait); out != 0 {
		return out
	}
	return outRewind
}

// commit records progress through the lease when jobs finished since the
// last commit.
func (r *runner) commit(ctx context.Context) error {
	r.lastCommit = time.Now()
	seq := r.finished
	if seq <= r.committed {
		return nil
	}
	if err := r.lease.Commit(ctx, seq); err != nil {
		r.event(ctx, Event{Kind: EventCommitFailed, Seq: seq, Err: err})
		if errors.Is(err, leasehold.ErrLeaseLost) {
			r.log.Warn("progress commit refused: another worker has fenced the partition", "seq", seq, "err", err)
		} else {
			r.log.Warn("progress commit failed; retrying at the next one", "seq", seq, "err", err)
		}
		return err
	}
	r.committed = seq
	r.committedSeq.Store(seq)
	r.touch()
	r.event(ctx, Event{Kind: EventProgressCommitted, Seq: seq})
	if r.w.cfg.TrimCommitted && r.w.jobs != nil {
		if err := r.w.jobs.Purge(ctx, jetstream.WithPurgeSubject(r.subject), jetstream.WithPurgeSequence(seq+1)); err != nil {
			r.log.Debug("trimming committed jobs failed", "seq", seq, "err", err)
		}
	}
	return nil
}

// settle waits for the outstanding effects, stopping at the first failure.
func (r *runner) settle(ctx context.Context) {
	for len(r.window) > 0 {
		if seq, err := r.reap(ctx, true); err != nil {
			r.log.Warn("an effect was not stored; progress stops before its job", "seq", seq, "err", err)
			return
		}
		if ctx.Err() != nil {
			return
		}
	}
}
