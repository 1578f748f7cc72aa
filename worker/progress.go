package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// A partition's progress moves in steps. A job is completed when its
// handler returned and the runner sent its finals (or its dead letter is
// stored); it is finished when every one of its effects (or its dead
// letter) is acknowledged. Completed jobs wait in a window, in the order
// the runner completed them, so the next job need not wait for the
// previous job's acknowledgements, and an effect that fails sends the
// partition back to its job.
//
// A job is done once it and every job completed before it in this lease
// are finished: done follows completion order, not stream order. A final
// names in leasehold.HeaderAfter the job that completed before it on its
// subject, whatever its key, so a sink applies it only after that one; a
// job committed while one completed before it was lost would be re-run
// by a successor in its own lease, and the sink could never apply the
// later one. The watermark is the highest sequence up to which every job
// is done, and the done set holds the jobs done above it: progress commits
// both (coordinator.Lease.Commit), and a successor resumes after the
// watermark, skipping the done set.

// jobRun is a job the runner fetched, from then until the watermark passes
// it.
type jobRun struct {
	seq   uint64
	m     jetstream.Msg
	md    *jetstream.MsgMetadata
	lane  laneKey
	phase jobPhase
	slot  slotKind // what it runs in, while it runs
	laned bool     // it was started from its lane, which it frees when it ends

	// Once completed, for the window.
	runs  int // attempts run, for a re-run after a failed effect
	futs  []jetstream.PubAckFuture
	acked int // futs[:acked] are acknowledged
	sent  time.Time
	asked time.Time // when its unacknowledged effect was last sent again (see resend)
	// What its finals changed in the runner's after map (see output.go),
	// for a rewind.
	undo []afterUndo
}

type jobPhase uint8

const (
	phaseQueued    jobPhase = iota // waiting in its lane
	phaseRunning                   // its attempts run in a goroutine of their own
	phaseCompleted                 // in the window: its effects are awaited
	phaseDone                      // finished, and so is every job completed before it
)

type slotKind uint8

const (
	slotNone slotKind = iota
	slotOwn           // the partition's own slot
	slotPool          // a slot of the worker's pool
)

// complete puts j, whose finals were sent (or whose dead letter is stored),
// in the window.
func (r *runner) complete(j *jobRun, runs int, futs []jetstream.PubAckFuture, undo []afterUndo) {
	j.phase, j.runs, j.futs, j.acked, j.sent, j.asked, j.undo = phaseCompleted, runs, futs, 0, time.Now(), time.Time{}, undo
	r.replayed(j)
	r.window = append(r.window, j)
}

// reap marks done the jobs at the head of the window whose effects are all
// acknowledged, and moves the watermark. With block, it waits until the
// oldest outstanding job is settled. It returns the first job with a
// failed effect.
func (r *runner) reap(ctx context.Context, block bool) (uint64, error) {
	defer r.advance()
	for len(r.window) > 0 {
		j := r.window[0]
		for j.acked < len(j.futs) {
			err, settled := r.await(ctx, j, block)
			if !settled {
				return 0, nil
			}
			if err != nil {
				return j.seq, err
			}
			j.acked++
		}
		r.markDone(j)
		r.window[0] = nil
		r.window = r.window[1:]
		block = false
	}
	return 0, nil
}

// acked handles the outcome of the window head's next publish, received
// by the runner's loop: one of ack and err is set.
func (r *runner) acked(ack *jetstream.PubAck, err error) (uint64, error) {
	j := r.window[0]
	fut := j.futs[j.acked]
	if err != nil {
		return j.seq, effectError(fut, err)
	}
	if err := r.stored(r.ctx, fut, ack); err != nil {
		return j.seq, err
	}
	j.acked++
	return r.reap(r.ctx, false)
}

// head is what the runner's loop waits on for the window's head: its next
// publish's outcome, or nil channels.
func (r *runner) head() (<-chan *jetstream.PubAck, <-chan error) {
	if len(r.window) == 0 {
		return nil, nil
	}
	j := r.window[0]
	if j.acked >= len(j.futs) {
		return nil, nil
	}
	return j.futs[j.acked].Ok(), j.futs[j.acked].Err()
}

// markDone marks j done: it joins the done set until the watermark passes it.
func (r *runner) markDone(j *jobRun) {
	j.phase, j.futs, j.undo = phaseDone, nil, nil
	j.m, j.md = nil, nil // kept until now for a replay
	if len(r.retries) > 0 {
		delete(r.retries, j.seq)
	}
	if i, found := slices.BinarySearch(r.doneSet, j.seq); !found {
		r.doneSet = slices.Insert(r.doneSet, i, j.seq)
	}
}

// advance moves the watermark over the done jobs at the head of the
// tracked ones, and drops them from the done set.
func (r *runner) advance() {
	n := 0
	for n < len(r.track) && r.track[n].phase == phaseDone {
		r.watermark = r.track[n].seq
		r.track[n] = nil
		n++
	}
	if n == 0 {
		return
	}
	r.track = r.track[n:]
	i, found := slices.BinarySearch(r.doneSet, r.watermark)
	if found {
		i++
	}
	r.doneSet = r.doneSet[i:]
}

// isDone reports whether the job at seq is done: at or below the
// watermark, or in the done set.
func (r *runner) isDone(seq uint64) bool {
	if seq <= r.watermark {
		return true
	}
	_, found := slices.BinarySearch(r.doneSet, seq)
	return found
}

// await checks the next unacknowledged publish of j; with block it waits
// for it, at most until the effect timeout.
func (r *runner) await(ctx context.Context, j *jobRun, block bool) (error, bool) {
	fut := j.futs[j.acked]
	select {
	case ack := <-fut.Ok():
		return r.stored(ctx, fut, ack), true
	case err := <-fut.Err():
		return effectError(fut, err), true
	default:
	}
	left := r.w.cfg.EffectTimeout - time.Since(j.sent)
	if left > 0 && !block {
		r.resend(j)
		return nil, false
	}
	if left > 0 {
		t := time.NewTimer(left)
		defer t.Stop()
		select {
		case ack := <-fut.Ok():
			return r.stored(ctx, fut, ack), true
		case err := <-fut.Err():
			return effectError(fut, err), true
		case <-ctx.Done():
			return context.Cause(ctx), true
		case <-t.C:
		}
	}
	return effectError(fut, fmt.Errorf("no acknowledgement within %v: %w", r.w.cfg.EffectTimeout, jetstream.ErrAsyncPublishTimeout)), true
}

// resend publishes j's next unacknowledged effect again once it has gone
// unanswered for syncTry, under the same Nats-Msg-Id (so the stream
// stores it once), and awaits the new publish instead, within the same
// EffectTimeout from j.sent. In a cluster, an acknowledgement lost with a
// stream leader that stepped down never comes on a connection that stays
// up, and waiting for it held the partition for the whole EffectTimeout
// (10 s by default). Nothing is sent again once the lease is gone.
func (r *runner) resend(j *jobRun) {
	last := j.asked
	if last.IsZero() {
		last = j.sent
	}
	if time.Since(last) < syncTry(r.w.cfg.EffectTimeout) || r.sendable() != nil {
		return
	}
	j.asked = time.Now()
	msg := j.futs[j.acked].Msg()
	fut, err := r.w.cfg.JetStream.PublishMsgAsync(msg)
	if err != nil {
		r.log.Debug("an effect's acknowledgement is late and sending it again failed", "seq", j.seq, "subject", msg.Subject, "err", err)
		return
	}
	j.futs[j.acked] = fut
	r.log.Info("an effect's acknowledgement is late: sent again", "seq", j.seq, "subject", msg.Subject, "waited", time.Since(j.sent).Round(time.Millisecond))
}

func effectError(fut jetstream.PubAckFuture, err error) error {
	return &EffectError{Subject: fut.Msg().Subject, Key: fut.Msg().Header.Get(jetstream.MsgIDHeader), Err: err}
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

// rewind handles a failed effect of job seq, once the jobs that were
// running have returned: every job above the watermark that is not done
// runs again under higher attempt numbers (their effects keep their
// idempotency keys, so what was stored is not stored twice): first the
// jobs whose finals were sent, in the order they completed, one at a time
// (replay.go), then the others, read again, in stream order per lane.
func (r *runner) rewind(seq uint64, err error) outcome {
	st := r.retries[seq]
	if i := slices.IndexFunc(r.window, func(j *jobRun) bool { return j.seq == seq }); i >= 0 {
		st.runs = max(st.runs, r.window[i].runs)
	}
	if r.counts(&st, err) {
		st.failures++
		st.dead = st.dead || IsPermanent(err) || st.failures >= r.w.cfg.MaxAttempts
	}
	st.err = err
	r.retries[seq] = st
	// Let the other publishes settle, so the re-run starts from a quiet
	// state; their outcome no longer matters. The failed publish is its
	// job's next one; those before it were acknowledged (and their
	// outcome consumed).
	ctx, cancel := context.WithTimeout(r.ctx, r.w.cfg.EffectTimeout)
	for _, j := range r.window {
		from := j.acked
		if j.seq == seq {
			from++
		}
		for _, f := range j.futs[min(from, len(j.futs)):] {
			select {
			case <-f.Ok():
			case <-f.Err():
			case <-ctx.Done():
			}
		}
	}
	cancel()
	r.unwind()
	r.w.tel.Metrics.JobsFailed.Add(r.ctx, 1)
	wait := r.w.cfg.Backoff(max(st.runs, 1))
	r.event(r.ctx, Event{Kind: EventJobFailed, Seq: seq, Attempt: st.runs, Err: err, Backoff: wait})
	r.log.Warn("an effect was not stored; running the partition again from its job", "seq", seq, "backoff", wait, "err", err)
	if out := r.sleep(wait, nil); out != 0 {
		return out
	}
	return outRewind
}

// commit records progress through the lease when the watermark or the
// done set changed since the last commit.
func (r *runner) commit(ctx context.Context) error {
	r.lastCommit = time.Now()
	seq := r.watermark
	if seq < r.committed || seq == r.committed && slices.Equal(r.doneSet, r.committedDone) {
		return nil
	}
	done := slices.Clone(r.doneSet)
	err := r.lease.Commit(ctx, seq, done...)
	r.commitFailed = err != nil
	if err != nil {
		r.event(ctx, Event{Kind: EventCommitFailed, Seq: seq, Err: err})
		if errors.Is(err, leasehold.ErrLeaseLost) {
			r.log.Warn("progress commit refused: another worker has fenced the partition", "seq", seq, "err", err)
		} else {
			r.log.Warn("progress commit failed; retrying at the next one", "seq", seq, "err", err)
		}
		return err
	}
	moved := seq > r.committed
	r.committed, r.committedDone = seq, done
	r.committedSeq.Store(seq)
	r.touch()
	r.event(ctx, Event{Kind: EventProgressCommitted, Seq: seq, Done: done})
	if moved && r.w.cfg.TrimCommitted && r.w.jobs != nil {
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
