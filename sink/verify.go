package sink

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/leasehold/leasehold"
)

// Verifier tells whether the lease bucket issued an epoch to a fence for
// an acquisition. *coordinator.Bucket satisfies it for the scopes it
// serves.
//
// VerifyAcquisition returns nil when it did. When it did not, it returns
// an error with a method Unverified() bool that reports true: a verdict
// on the stamp. Such an error may also have Forgotten() bool, true when
// the epoch is too old to verify rather than never issued to that fence,
// and RecordedEpoch() leasehold.Epoch, the newest epoch the fence has
// been issued. Any other error means the verifier could not tell; the
// write is not applied and may be retried.
type Verifier interface {
	VerifyAcquisition(ctx context.Context, id leasehold.FenceID, epoch leasehold.Epoch, acquisition string) error
}

// ErrUnverifiedEpoch is matched by the error a sink with verified epochs
// returns for an epoch and acquisition the lease bucket did not issue to
// the write's fence: an epoch never issued, one issued to another fence
// (another partition, a lock), or the epoch of an acquisition with another
// token. Nothing was applied and the fence did not move. Match it with
// errors.Is; use errors.As with *UnverifiedEpochError for the details.
var ErrUnverifiedEpoch = errors.New("sink: epoch and acquisition were not issued to the fence by the lease bucket")

// ErrForgottenEpoch is matched, besides ErrUnverifiedEpoch, by the refusal
// of an epoch older than every acquisition the fence record remembers
// (coordinator.FenceHistory): it may have been issued, but can no longer
// be verified. A sink that reads a log meets it when it reaches a holder's
// effects only after the fence changed hands that many times since; those
// effects are refused, and their jobs may have been committed.
var ErrForgottenEpoch = errors.New("sink: epoch is older than the fence record remembers")

// UnverifiedEpochError reports an epoch and acquisition the lease bucket
// did not issue to the write's fence.
type UnverifiedEpochError struct {
	Scope       string
	Partition   leasehold.Partition
	Epoch       leasehold.Epoch // the epoch the write carried
	Acquisition string          // the acquisition the write carried
	// Fenced is the newest epoch issued to the fence, when the verifier
	// says.
	Fenced leasehold.Epoch
	Key    string
	// Forgotten says the epoch is older than the fence record remembers
	// (ErrForgottenEpoch).
	Forgotten bool
	// Err is the verifier's verdict: why the epoch and acquisition were
	// not issued to the fence, or why the bucket issues nothing to it
	// (another scope, a partition outside the job stream).
	Err error
}

func (e *UnverifiedEpochError) Error() string {
	what := fmt.Sprintf("sink: scope %s partition %d: epoch %d", e.Scope, e.Partition, e.Epoch)
	if e.Acquisition != "" {
		what += " of acquisition " + e.Acquisition
	}
	switch {
	case e.Forgotten:
		return fmt.Sprintf("%s cannot be verified: %v: the write was not applied; if it is a former holder's, this sink is further behind than the fence record remembers; key %q", what, e.Err, e.Key)
	case e.Err != nil:
		return fmt.Sprintf("%s was not issued to this fence: %v: the stamp is forged or garbled, and the write was not applied; key %q", what, e.Err, e.Key)
	}
	return fmt.Sprintf("%s was never issued by the lease bucket (the highest issued is %d): the stamp is forged or garbled, and the write was not applied; key %q",
		what, e.Fenced, e.Key)
}

// Is makes errors.Is(err, ErrUnverifiedEpoch) true, and errors.Is(err,
// ErrForgottenEpoch) for a forgotten epoch.
func (e *UnverifiedEpochError) Is(target error) bool {
	return target == ErrUnverifiedEpoch || (e.Forgotten && target == ErrForgottenEpoch)
}

// Unwrap returns the verifier's verdict.
func (e *UnverifiedEpochError) Unwrap() error { return e.Err }

// unverified reports whether a verifier's error is a verdict on the stamp
// rather than a failure to ask.
func unverified(err error) bool {
	var u interface{ Unverified() bool }
	return errors.As(err, &u) && u.Unverified()
}

// newUnverified builds the refusal of stamp s from the verifier's verdict.
func newUnverified(s leasehold.Stamp, verdict error) *UnverifiedEpochError {
	e := &UnverifiedEpochError{Scope: s.Scope, Partition: s.Partition, Epoch: s.Epoch, Acquisition: s.Acquisition, Key: s.Key, Err: verdict}
	var f interface{ Forgotten() bool }
	e.Forgotten = errors.As(verdict, &f) && f.Forgotten()
	var r interface{ RecordedEpoch() leasehold.Epoch }
	if errors.As(verdict, &r) {
		e.Fenced = r.RecordedEpoch()
	}
	return e
}

// EpochCheck decides whether a stamp may raise its fence: a raise to
// (epoch, acquisition) is admitted only if the lease bucket issued that
// epoch to that fence for that acquisition (see Verifier, and
// coordinator.Bucket.VerifyAcquisition).
//
// Every raise is verified: to a higher epoch, and to the same epoch over a
// fence that recorded no acquisition (leasehold.Judge admits it and
// records the acquisition, which from then on refuses every other at that
// epoch as a split brain). Writes that raise nothing (the fence's own
// epoch and acquisition, or a refusal) need no check.
//
// It is not "the epoch is the current lease's", because a sink that
// consumes an effect log in order may meet a former holder's effects after
// the partition changed hands, and refusing them would lose effects whose
// progress was committed: a former holder's (epoch, acquisition) stays
// verifiable while the fence record remembers it. Nor is it "the epoch is
// at or below the highest issued", which admits an epoch issued to another
// fence of the bucket, or the live holder's epoch with a made-up
// acquisition, either of which then fences the holder out.
//
// Verified pairs are cached per fence (a few each, for a bounded number of
// fences), so a fence's steady state costs nothing. A verifier that does
// not answer gives an error that is not a verdict: the write is not
// applied, and the caller retries it.
//
// A nil *EpochCheck admits every raise.
type EpochCheck struct {
	v Verifier

	mu       sync.Mutex
	verified map[leasehold.FenceID]*verifiedPairs
}

// verifiedPerFence is how many verified (epoch, acquisition) pairs a fence
// keeps, and maxVerifiedFences how many fences: forged stamps never get
// in, so the fences are those the bucket issued epochs to.
const (
	verifiedPerFence  = 4
	maxVerifiedFences = 1 << 16
)

// verifiedPairs are a fence's verified (epoch, acquisition) pairs, the
// newest kept.
type verifiedPairs struct {
	n     int
	pairs [verifiedPerFence]struct {
		epoch       leasehold.Epoch
		acquisition string
	}
}

func (v *verifiedPairs) has(e leasehold.Epoch, a string) bool {
	for i := range v.n {
		if v.pairs[i].epoch == e && v.pairs[i].acquisition == a {
			return true
		}
	}
	return false
}

// add keeps (e, a), in place of the oldest pair when full.
func (v *verifiedPairs) add(e leasehold.Epoch, a string) {
	i := v.n
	if i == verifiedPerFence {
		i = 0
		for j := 1; j < v.n; j++ {
			if v.pairs[j].epoch < v.pairs[i].epoch {
				i = j
			}
		}
	} else {
		v.n++
	}
	v.pairs[i].epoch, v.pairs[i].acquisition = e, a
}

// NewEpochCheck returns a check against v, or nil (no checking) when v is
// nil.
func NewEpochCheck(v Verifier) *EpochCheck {
	if v == nil {
		return nil
	}
	return &EpochCheck{v: v, verified: make(map[leasehold.FenceID]*verifiedPairs)}
}

// Check returns nil if the lease bucket issued stamp s's epoch to its
// fence for its acquisition, an *UnverifiedEpochError if it did not, or
// the error that kept the bucket from answering.
func (c *EpochCheck) Check(ctx context.Context, s leasehold.Stamp) error {
	if c == nil {
		return nil
	}
	id := s.Fence()
	c.mu.Lock()
	v := c.verified[id]
	ok := v != nil && v.has(s.Epoch, s.Acquisition)
	c.mu.Unlock()
	if ok {
		return nil
	}
	err := c.v.VerifyAcquisition(ctx, id, s.Epoch, s.Acquisition)
	if unverified(err) {
		return newUnverified(s, err)
	}
	if err != nil {
		return fmt.Errorf("sink: verify epoch %d of %s (acquisition %s) against the lease bucket: %w", s.Epoch, id, s.Acquisition, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if v = c.verified[id]; v == nil {
		if len(c.verified) >= maxVerifiedFences {
			for old := range c.verified {
				delete(c.verified, old)
				break
			}
		}
		v = &verifiedPairs{}
		c.verified[id] = v
	}
	if !v.has(s.Epoch, s.Acquisition) {
		v.add(s.Epoch, s.Acquisition)
	}
	return nil
}

// CheckRaise runs Check only when s would raise fence f (see
// leasehold.Judge): to a higher epoch, or to f's epoch when f recorded no
// acquisition. A stamp that raises nothing, or that f refuses, needs no
// check.
func (c *EpochCheck) CheckRaise(ctx context.Context, s leasehold.Stamp, f leasehold.FenceState) error {
	if c == nil {
		return nil
	}
	if v, raise := leasehold.Judge(f, s); v != leasehold.Admit || !raise {
		return nil
	}
	return c.Check(ctx, s)
}
