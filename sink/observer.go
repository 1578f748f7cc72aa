package sink

import (
	"context"

	"github.com/leasehold/leasehold"
)

// Outcome is what a sink decided about one effect (or barrier).
type Outcome uint8

// Outcomes a sink reports.
const (
	// Accepted: the effect was applied.
	Accepted Outcome = iota + 1
	// Duplicate: the effect's idempotency key was applied before; it was
	// admitted and not applied again. Apply returns nil.
	Duplicate
	// Stale: the effect's epoch is below the partition's recorded maximum;
	// nothing was applied. Err is a *leasehold.StaleEpochError.
	Stale
	// BadStamp: the stamp was missing or malformed; nothing was applied.
	// Err matches leasehold.ErrBadStamp.
	BadStamp
	// Unverified: the write would raise its fence to an epoch and
	// acquisition the lease bucket did not issue to that fence; nothing was
	// applied. Err matches ErrUnverifiedEpoch.
	Unverified
	// Advanced: a barrier or Advance raised the partition's maximum.
	Advanced
	// SplitBrain: the effect's epoch equals the fence's but comes from
	// another acquisition; nothing was applied. Err is a
	// *leasehold.StaleEpochError matching leasehold.ErrSplitBrain.
	SplitBrain
	// OverLimit: recording the effect's fence would take the sink beyond
	// a bound of its own (how many fences it keeps, the size of its saved
	// state); nothing was applied. Err says which bound.
	OverLimit
	// DeadLettered: the sink could not apply the effect (every attempt
	// failed, or it can never be applied: too large, a destination that
	// refuses it) and moved it to its dead-letter stream with the error;
	// it was not applied.
	DeadLettered
	// Aborted: the effect belongs to an attempt of a job that did not
	// complete (it failed, was superseded by a later attempt or skipped by
	// a later job, or its lease was taken over before it completed); it
	// was not applied, and none of the attempt's effects are.
	Aborted
	// Failed: the sink could not decide or apply (a network or database
	// error); the effect may be retried. Err says why. It stays last.
	Failed
)

func (o Outcome) String() string {
	switch o {
	case Accepted:
		return "accepted"
	case Duplicate:
		return "duplicate"
	case Stale:
		return "stale"
	case BadStamp:
		return "bad_stamp"
	case Unverified:
		return "unverified"
	case Advanced:
		return "advanced"
	case SplitBrain:
		return "split_brain"
	case OverLimit:
		return "over_limit"
	case DeadLettered:
		return "dead_lettered"
	case Aborted:
		return "aborted"
	case Failed:
		return "failed"
	}
	return "unknown"
}

// Dropped reports whether the outcome refused the effect for good: it will
// not be applied however often it is retried.
func (o Outcome) Dropped() bool {
	return o == Stale || o == BadStamp || o == Unverified || o == SplitBrain || o == OverLimit
}

// Decision is one sink decision, as an Observer sees it.
type Decision struct {
	Sink    string // the sink's name, for spans and metrics
	Outcome Outcome
	// Stamp is the effect's stamp; for BadStamp, as much of it as was read.
	Stamp   leasehold.Stamp
	Subject string
	// Max is the fence's recorded maximum the effect was judged against,
	// when the sink knows it, and MaxAcquisition the acquisition that set
	// it.
	Max            leasehold.Epoch
	MaxAcquisition string
	// Holder is the worker that holds the partition now, when known.
	Holder string
	// Position is the effect's place in the log it was read from (a
	// stream sequence), for sinks that consume a log; 0 otherwise.
	Position uint64
	Err      error
	// Suspect, when set, says why the sink set this message aside as
	// suspicious: a marker (an abort, an attempt number, a final) that no
	// worker writes the way it came, which a forger or a garbled copy can
	// have made. It was counted in leasehold_sink_markers_suspicious_total
	// under this reason and changed nothing the message's worker did. The
	// stream sink runner's reasons are its Suspect* constants.
	Suspect string
}

// Observer receives every decision a sink makes, for tracing, metrics and
// history checks. Implementations must be safe for concurrent use, fast,
// and must not block: they run on the write path.
type Observer interface {
	Decided(ctx context.Context, d Decision)
}

// ObserverFunc adapts a function to an Observer.
type ObserverFunc func(ctx context.Context, d Decision)

// Decided calls f.
func (f ObserverFunc) Decided(ctx context.Context, d Decision) { f(ctx, d) }

// Observers fans each decision out to several observers, in order.
type Observers []Observer

// Decided calls every observer.
func (os Observers) Decided(ctx context.Context, d Decision) {
	for _, o := range os {
		o.Decided(ctx, d)
	}
}

type nopObserver struct{}

func (nopObserver) Decided(context.Context, Decision) {}
