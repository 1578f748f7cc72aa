// Package sink defines the fence contract every leasehold sink keeps, and
// the sinks that keep it.
//
// The contract: a sink records, per partition, the highest epoch it has
// accepted. It applies an effect only if the effect's epoch is at least that
// maximum, and the check and the write are one atomic step: there is no
// moment between them at which a newer epoch could be recorded. Equal
// epochs are accepted, since one holder writes many times. A stale effect
// has no effect at all; Apply returns a *leasehold.StaleEpochError, which
// matches leasehold.ErrStaleEpoch. Sinks that dedupe apply each idempotency
// key once, and report a repeat as success.
//
// Advance raises a partition's maximum without applying anything: a worker
// calls it when it acquires a partition, so that a former holder's writes
// are refused from the moment of take-over, not from the new holder's first
// write. A sink that consumes an effect log in order learns the take-over
// from the barrier the new holder publishes into the log
// (leasehold.HeaderBarrier), and from nothing else: an earlier holder's
// effect published before the barrier may be committed progress.
//
// Every decision (accepted, duplicate, stale, bad stamp, unverified epoch,
// failure) goes to an Observer and is counted in
// leasehold_sink_effects_total; drops are counted per partition, logged
// with rate limiting, traced (a refusal for a stale epoch is a span with
// error.type=stale_epoch under the writer's span; see Reporter), and
// returned to the caller.
//
// With verified epochs (an EpochCheck against the lease bucket), an epoch
// above the recorded maximum raises it only if the lease bucket has fenced
// the partition at that epoch or later, so a forged or garbled epoch cannot
// fence out the legitimate holder.
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
	// *leasehold.StaleEpochError when an effect is stale, and an error
	// matching leasehold.ErrBadStamp when a stamp is invalid.
	Apply(ctx context.Context, effects ...Effect) error
	// Advance raises partition p's recorded maximum to e if it is lower.
	Advance(ctx context.Context, p leasehold.Partition, e leasehold.Epoch) error
	// MaxEpoch returns partition p's recorded maximum, 0 if none.
	MaxEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error)
}

// Fence is the part of a Sink that records the maxima, for consumers that
// fence in a single-writer critical section of their own (see wmsink).
type Fence interface {
	Advance(ctx context.Context, p leasehold.Partition, e leasehold.Epoch) error
	MaxEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error)
}

// WithHolder returns a context that names worker as the one a fence is
// advanced for. A worker advances its fences under it, and the sinks of
// this module record the name with the new maximum, so that a refusal
// between the take-over and the new holder's first write can say who
// holds the partition.
func WithHolder(ctx context.Context, worker string) context.Context {
	return context.WithValue(ctx, holderKey{}, worker)
}

// HolderFrom returns the worker WithHolder put in ctx, or "".
func HolderFrom(ctx context.Context) string {
	h, _ := ctx.Value(holderKey{}).(string)
	return h
}

type holderKey struct{}

// ErrEmptyBatch is returned by Apply called with no effects.
var ErrEmptyBatch = errors.New("sink: Apply needs at least one effect")

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

// StaleError builds the error for effect stamp s refused under max.
func StaleError(s leasehold.Stamp, max leasehold.Epoch, holder string) *leasehold.StaleEpochError {
	return &leasehold.StaleEpochError{Partition: s.Partition, Epoch: s.Epoch, Max: max, Key: s.Key, Worker: s.Worker, Holder: holder}
}

// ValidateAdvance checks the arguments of Advance.
func ValidateAdvance(p leasehold.Partition, e leasehold.Epoch) error {
	return leasehold.Stamp{Partition: p, Epoch: e, Key: "advance"}.Validate()
}
