// Package sink defines the fence contract every leasehold sink keeps, and
// the sinks that keep it.
//
// The contract: a sink records, per fence (a scope and a partition, see
// leasehold.FenceID), the highest epoch it has accepted and the acquisition
// that epoch came from. It applies an effect only if leasehold.Judge
// admits the effect's stamp against that record, and the check and the
// write are one atomic step: there is no moment between them at which a
// newer epoch could be recorded. Equal epochs of one acquisition are
// accepted, since one holder writes many times; an equal epoch of another
// acquisition is a split-brain write and is refused. A refused effect has
// no effect at all; Apply returns a *leasehold.StaleEpochError, which
// matches leasehold.ErrStaleEpoch (and leasehold.ErrSplitBrain for a split
// brain). Fences of different scopes never affect each other: one sink
// serves any number of job streams and locks. Sinks that dedupe apply each
// (scope, idempotency key) once, and report a repeat as success.
//
// Advance raises a fence without applying anything: a worker calls it with
// its lease when it acquires a partition, so that a former holder's writes
// are refused from the moment of take-over, not from the new holder's first
// write. Advancing with an epoch below the fence's returns the stale-epoch
// error: the caller is no longer the newest holder. A sink that consumes an
// effect log in order learns the take-over from the barrier the new holder
// publishes into the log (leasehold.HeaderBarrier), and from nothing else:
// an earlier holder's effect published before the barrier may be committed
// progress.
//
// Every decision (accepted, duplicate, stale, split brain, bad stamp,
// unverified epoch, failure) goes to an Observer and is counted in
// leasehold_sink_effects_total; drops are counted per fence, logged with
// rate limiting, traced (a refusal is a span with error.type=stale_epoch or
// split_brain under the writer's span; see Reporter), and returned to the
// caller.
//
// With verified epochs (an EpochCheck against the lease bucket), a write
// raises its fence only to an epoch and acquisition the lease bucket issued
// to that fence (see Verifier), so a forged or garbled stamp, an epoch
// issued to another fence, or the holder's epoch with a made-up acquisition
// cannot fence out the legitimate holder.
//
// The sinks: Memory (the reference, in this package), kvsink (JetStream
// KV), streamsink (a runner over a JetStream effect log), pgsink
// (PostgreSQL) and wmsink (Watermill middleware). testing/sinktest is the
// conformance suite they all pass.
package sink

import (
	"context"
	"errors"
	"fmt"

	"github.com/leasehold/leasehold"
)

// Effect is one fenced write: what to write, and the stamp that says under
// which lease it was produced.
type Effect struct {
	Stamp leasehold.Stamp
	// Subject says where the effect goes; its meaning is the sink's: a KV
	// key, a stream subject, a row's identifier.
	Subject string
	Data    []byte
	// Header carries extra headers, such as W3C trace context, to sinks
	// that keep them. Optional.
	Header map[string][]string
}

// Sink applies effects under the fence contract.
type Sink interface {
	// Apply applies the effects, in order, if every one of them is admitted;
	// sinks that support atomic batches apply all or none. It returns a
	// *leasehold.StaleEpochError when an effect is refused by its fence,
	// and an error matching leasehold.ErrBadStamp when a stamp is invalid.
	Apply(ctx context.Context, effects ...Effect) error
	Fencer
}

// Fencer is the part of a Sink that records the fences, for consumers that
// fence in a critical section of their own (see wmsink), and for workers
// that fence a sink when they acquire a partition.
type Fencer interface {
	// Advance raises the fence of l's scope and partition to l's epoch and
	// acquisition, recording l.Holder as the holder. It returns a
	// *leasehold.StaleEpochError when the fence is already above l's epoch
	// (or at it, for another acquisition): l is no longer the newest lease.
	Advance(ctx context.Context, l leasehold.Lease) error
	// Fence returns what the sink records for id; the zero FenceState if
	// nothing.
	Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error)
}

// ErrEmptyBatch is returned by Apply called with no effects.
var ErrEmptyBatch = errors.New("sink: Apply needs at least one effect")

// ErrUnavailable marks an error of a destination that cannot serve now
// (unreachable, restarting, out of resources): the effect is not to
// blame, and trying it again later may succeed. A stream sink runner
// retries such a failure without counting it towards dead-lettering the
// effect, as it does a failure of NATS, so that a database restart moves
// nothing to the dead-letter stream; a runner held up by it shows in its
// Ready check. pgsink marks its errors so; a Handler may wrap its own.
var ErrUnavailable = errors.New("sink: the destination cannot serve now")

// ValidateEffects checks every effect's stamp and returns the index of the
// first invalid one and its error (matching leasehold.ErrBadStamp), or -1
// and nil.
func ValidateEffects(effects []Effect) (int, error) {
	if len(effects) == 0 {
		return -1, ErrEmptyBatch
	}
	for i := range effects {
		if err := effects[i].Stamp.Validate(); err != nil {
			return i, fmt.Errorf("sink: effect %d of %d (subject %q): %w", i+1, len(effects), effects[i].Subject, err)
		}
	}
	return -1, nil
}

// StaleError builds the error for effect stamp s refused as stale under
// fence f.
func StaleError(s leasehold.Stamp, f leasehold.FenceState) *leasehold.StaleEpochError {
	return leasehold.Refusal(f, s, leasehold.Stale)
}

// AdvanceStamp is the stamp an Advance with lease l is judged as: l's
// fence, epoch and acquisition, with no idempotency key of its own.
func AdvanceStamp(l leasehold.Lease) leasehold.Stamp { return l.Stamp("advance") }

// ValidateAdvance checks the lease given to Advance.
func ValidateAdvance(l leasehold.Lease) error {
	return AdvanceStamp(l).Validate()
}

// Refused reports the outcome a verdict other than Admit gives.
func Refused(v leasehold.Verdict) Outcome {
	if v == leasehold.SplitBrain {
		return SplitBrain
	}
	return Stale
}
