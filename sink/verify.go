package sink

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/leasehold/leasehold"
)

// Verifier tells the highest epoch the lease bucket has issued for a
// fence. *coordinator.Bucket satisfies it for the scopes it serves.
type Verifier interface {
	IssuedEpoch(ctx context.Context, id leasehold.FenceID) (leasehold.Epoch, error)
}

// ErrUnverifiedEpoch is matched by the error a sink with verified epochs
// returns for an epoch the lease bucket never issued: it is above every
// epoch under which the partition has been fenced. Nothing was applied and
// the partition's maximum did not move. Match it with errors.Is; use
// errors.As with *UnverifiedEpochError for the details.
var ErrUnverifiedEpoch = errors.New("sink: epoch was never issued by the lease bucket")

// UnverifiedEpochError reports an epoch the lease bucket did not issue.
type UnverifiedEpochError struct {
	Scope     string
	Partition leasehold.Partition
	Epoch     leasehold.Epoch // the epoch the write carried
	Fenced    leasehold.Epoch // the highest epoch the lease bucket issued
	Key       string
	// Err, when set, is why the lease bucket issues no epochs at all for
	// the fence (another scope, a partition outside the job stream).
	Err error
}

func (e *UnverifiedEpochError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("sink: scope %s partition %d: epoch %d cannot have been issued: %v: the stamp is forged or garbled, and the write was not applied; key %q",
			e.Scope, e.Partition, e.Epoch, e.Err, e.Key)
	}
	return fmt.Sprintf("sink: scope %s partition %d: epoch %d was never issued by the lease bucket (the highest issued is %d): the stamp is forged or garbled, and the write was not applied; key %q",
		e.Scope, e.Partition, e.Epoch, e.Fenced, e.Key)
}

// Is makes errors.Is(err, ErrUnverifiedEpoch) true.
func (e *UnverifiedEpochError) Is(target error) bool { return target == ErrUnverifiedEpoch }

// Unwrap returns why the fence is unknown, if it is.
func (e *UnverifiedEpochError) Unwrap() error { return e.Err }

// unverified reports whether a verifier's error is a verdict on the stamp
// (coordinator.UnknownFenceError: a fence the lease bucket does not serve)
// rather than a failure to ask.
func unverified(err error) bool {
	var u interface{ Unverified() bool }
	return errors.As(err, &u) && u.Unverified()
}

// EpochCheck decides whether an epoch above a partition's recorded maximum
// may raise it. It caches the fenced epoch of each partition and reads it
// again only for an epoch above the cached value.
//
// The rule is: epoch E may raise the maximum only if E <= FencedEpoch(p).
// It is not "E equals the current lease epoch", because a sink that
// consumes an effect log in order may meet a former holder's effect after
// the new holder fenced the partition, and refusing it would lose an
// effect whose progress was committed. An epoch at or below the fenced one
// cannot fence out the legitimate holder, whose epoch is the fenced one;
// only an epoch above it can, and the lease bucket never issued such an
// epoch for this partition, so it is a forgery or garbage.
//
// A nil *EpochCheck admits every epoch.
type EpochCheck struct {
	v Verifier

	mu     sync.Mutex
	fenced map[leasehold.FenceID]leasehold.Epoch
}

// NewEpochCheck returns a check against v, or nil (no checking) when v is
// nil.
func NewEpochCheck(v Verifier) *EpochCheck {
	if v == nil {
		return nil
	}
	return &EpochCheck{v: v, fenced: make(map[leasehold.FenceID]leasehold.Epoch)}
}

// Check returns nil if stamp s may raise its partition's maximum, an
// *UnverifiedEpochError if its epoch was never issued, or the error that
// kept the lease bucket from answering.
func (c *EpochCheck) Check(ctx context.Context, s leasehold.Stamp) error {
	if c == nil {
		return nil
	}
	id := s.Fence()
	c.mu.Lock()
	cached := c.fenced[id]
	c.mu.Unlock()
	if s.Epoch <= cached {
		return nil
	}
	fenced, err := c.v.IssuedEpoch(ctx, id)
	if unverified(err) {
		return &UnverifiedEpochError{Scope: s.Scope, Partition: s.Partition, Epoch: s.Epoch, Key: s.Key, Err: err}
	}
	if err != nil {
		return fmt.Errorf("sink: verify epoch %d of %s against the lease bucket: %w", s.Epoch, id, err)
	}
	c.mu.Lock()
	if fenced > c.fenced[id] {
		c.fenced[id] = fenced
	}
	c.mu.Unlock()
	if s.Epoch <= fenced {
		return nil
	}
	return &UnverifiedEpochError{Scope: s.Scope, Partition: s.Partition, Epoch: s.Epoch, Fenced: fenced, Key: s.Key}
}

// CheckAbove runs Check only when s's epoch is above max: epochs at or
// below the recorded maximum cannot raise it, so they need no check.
func (c *EpochCheck) CheckAbove(ctx context.Context, s leasehold.Stamp, max leasehold.Epoch) error {
	if c == nil || s.Epoch <= max {
		return nil
	}
	return c.Check(ctx, s)
}
