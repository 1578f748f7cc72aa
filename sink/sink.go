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
// write.
package sink

import (
	"context"

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
