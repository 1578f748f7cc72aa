package wmsink

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// MaxFences bounds the fences a Fencer keeps in arrival order, and per
// log: forged stamps can name any number of scopes. A message that would
// create one more is refused (sink.OverLimit).
const MaxFences = 1 << 17

// ErrFenceLimit is matched by the refusal of a message that would create a
// fence beyond MaxFences.
var ErrFenceLimit = errors.New("wmsink: fence limit reached")

func (f *Fencer) lock(id leasehold.FenceID) *sync.Mutex {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.locks[id]
	if l == nil {
		l = &sync.Mutex{}
		f.locks[id] = l
	}
	return l
}

// judgeArrival judges st against its fence as the messages decided before
// it, in this process, left it, and raises the fence if st is above it.
func (f *Fencer) judgeArrival(ctx context.Context, st leasehold.Stamp) (judgement, error) {
	l := f.lock(st.Fence())
	l.Lock()
	defer l.Unlock()
	j, err := f.judgeArrivalLocked(ctx, st)
	if err == nil && j.raises() {
		f.raiseLocked(st)
	}
	return j, err
}

// raises reports whether the judged stamp is admitted above its fence.
func (j judgement) raises() bool {
	return j.unverified == nil && j.v == leasehold.Admit && j.raise
}

// raiseLocked records st as its fence's newest admitted acquisition; the
// fence's lock is held.
func (f *Fencer) raiseLocked(st leasehold.Stamp) {
	f.mu.Lock()
	f.fences[st.Fence()] = leasehold.FenceState{Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: st.Worker}
	f.mu.Unlock()
}

// judgeArrivalLocked judges st with the fence's lock held, and raises
// nothing: the caller raises the fence when st's step is done.
func (f *Fencer) judgeArrivalLocked(ctx context.Context, st leasehold.Stamp) (judgement, error) {
	id := st.Fence()
	f.mu.Lock()
	fs, known := f.fences[id]
	full := !known && len(f.fences) >= MaxFences
	f.mu.Unlock()
	if full {
		return judgement{unverified: fmt.Errorf("%w: %d fences kept, fence %s would be one more", ErrFenceLimit, MaxFences, id)}, nil
	}
	return f.judgeChecked(ctx, fs, st)
}

// Fence runs apply if the stamp in metadata md is admitted in arrival
// order (Config.UnsafeArrivalOrder), holding the fence's critical section
// across the check, apply and the raise: for a caller outside Watermill
// that is the only writer of the fence's destination. It is exact when the
// caller feeds the messages of a log in their order and applies each
// before it takes the next; a message it comes back to after a later one
// is judged after it. apply must not wait for another message of the same
// fence. The fence is raised once apply has returned nil, so State never
// shows an epoch whose effect is not applied, and a failed apply leaves
// the fence as it was. It returns a *leasehold.StaleEpochError for a stale
// stamp, an error matching leasehold.ErrBadStamp for bad metadata, one
// matching sink.ErrUnverifiedEpoch for a forged epoch, and apply's error.
// A barrier raises the fence and does not call apply; a barrier below the
// fence (a late one of an earlier acquisition) moves nothing and is not
// reported as a drop, and its *leasehold.StaleEpochError tells the caller
// that the fence is past it: ack it like any refusal. A caller that sends
// barriers itself learns from this, in the same critical section, whether
// its acquisition is still the newest.
func (f *Fencer) Fence(ctx context.Context, md map[string]string, apply func() error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("wmsink: %w", err)
	}
	if !f.cfg.UnsafeArrivalOrder {
		return fmt.Errorf("%w: Fence judges in arrival order; set Config.UnsafeArrivalOrder", ErrNoPosition)
	}
	st, err := leasehold.StampFromMetadata(md)
	ctx, span := f.rep.StartProcess(ctx, telemetry.MetadataCarrier(md), "", st)
	defer span.End()
	d := sink.Decision{Stamp: st}
	if err != nil {
		d.Outcome, d.Err = sink.BadStamp, fmt.Errorf("wmsink: message metadata: %w", err)
		f.rep.Report(ctx, d)
		return d.Err
	}
	l := f.lock(st.Fence())
	l.Lock()
	defer l.Unlock()
	j, err := f.judgeArrivalLocked(ctx, st)
	d.Max, d.MaxAcquisition, d.Holder = j.fence.Epoch, j.fence.Acquisition, j.fence.Holder
	barrier := isBarrier(md)
	switch {
	case err != nil:
		d.Outcome, d.Err = sink.Failed, err
		f.rep.Report(ctx, d)
		return err
	case j.unverified != nil:
		d.Outcome, d.Err = outcomeOf(j.unverified), j.unverified
		f.rep.Report(ctx, d)
		return j.unverified
	case j.v != leasehold.Admit:
		serr := leasehold.Refusal(j.fence, st, j.v)
		if barrier && j.v == leasehold.Stale {
			return serr // a late barrier of an earlier acquisition: no drop
		}
		d.Outcome, d.Err = sink.Refused(j.v), serr
		f.rep.Report(ctx, d)
		return serr
	case barrier:
		if j.raise {
			f.raiseLocked(st)
			d.Outcome, d.Max = sink.Advanced, st.Epoch
			f.rep.Report(ctx, d)
		}
		return nil
	case isAbort(md):
		d.Outcome, d.Max = sink.Aborted, st.Epoch
		f.rep.Report(ctx, d)
		return nil
	}
	d.Max = st.Epoch
	if err := apply(); err != nil {
		d.Outcome, d.Err = sink.Failed, err
		f.rep.Report(ctx, d)
		return err
	}
	if j.raise {
		f.raiseLocked(st)
	}
	d.Outcome = sink.Accepted
	f.rep.Report(ctx, d)
	return nil
}

// outcomeOf is the outcome of a refusal that is not a verdict of the
// fence: an epoch never issued, or a fence beyond the limit.
func outcomeOf(err error) sink.Outcome {
	if errors.Is(err, ErrFenceLimit) {
		return sink.OverLimit
	}
	return sink.Unverified
}
