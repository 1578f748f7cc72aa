package leasehold

import (
	"errors"
	"fmt"
)

// ErrStaleEpoch is returned when a write carries an epoch below the highest
// one the destination has accepted for its partition: the writer lost its
// lease, and the write was not applied. Match it with errors.Is; use
// errors.As with *StaleEpochError for the details.
var ErrStaleEpoch = errors.New("leasehold: stale epoch")

// ErrLeaseLost is the cause of a lease context's cancellation, and the error
// of operations tried on a lease that is no longer held: a renewal was
// refused, the local deadline passed, or another worker holds the partition.
var ErrLeaseLost = errors.New("leasehold: lease lost")

// ErrBadStamp is matched by every error about a missing or malformed
// leasehold header.
var ErrBadStamp = errors.New("leasehold: bad stamp")

// ErrSplitBrain is matched by the error for a write whose epoch equals the
// fence's but comes from another acquisition: the lease bucket handed one
// revision to two acquisitions (it lost acknowledged writes after a power
// failure without sync_interval: always, or was restored from a copy).
// Such an error also matches ErrStaleEpoch, since the writer must stop.
var ErrSplitBrain = errors.New("leasehold: split brain: two acquisitions with one epoch")

// StaleEpochError reports a refused write: its epoch is below the fence's
// recorded maximum, or (SplitBrain) equal to it but from another
// acquisition.
type StaleEpochError struct {
	Scope          string
	Partition      Partition
	Epoch          Epoch  // the epoch the write carried
	Acquisition    string // the acquisition the write came from
	Max            Epoch  // the highest epoch accepted for the fence
	MaxAcquisition string // the acquisition that set Max, when known
	Key            string
	Worker         string // the writer, when the stamp named it
	Holder         string // the current holder, when known
	SplitBrain     bool
}

func (e *StaleEpochError) Error() string {
	who := "this worker"
	if e.Worker != "" {
		who = "worker " + e.Worker
	}
	where := fmt.Sprintf("partition %d", e.Partition)
	if e.Scope != "" {
		where = fmt.Sprintf("scope %s partition %d", e.Scope, e.Partition)
	}
	var msg string
	if e.SplitBrain {
		msg = fmt.Sprintf("leasehold: %s: epoch %d was also issued to another acquisition (%s, not %s): the lease bucket handed one revision to two holders, and the write of %s was not applied; fence the partition again (`leasehold fence`) and run NATS with sync_interval: always",
			where, e.Epoch, e.MaxAcquisition, e.Acquisition, who)
	} else {
		msg = fmt.Sprintf("leasehold: %s: epoch %d is below the recorded %d: %s lost its lease and the write was not applied",
			where, e.Epoch, e.Max, who)
	}
	if e.Holder != "" {
		msg += " (the partition is held by " + e.Holder + ")"
	}
	return msg
}

// Is makes errors.Is(err, ErrStaleEpoch) true, and errors.Is(err,
// ErrSplitBrain) for a split-brain refusal.
func (e *StaleEpochError) Is(target error) bool {
	return target == ErrStaleEpoch || (e.SplitBrain && target == ErrSplitBrain)
}

// StampError reports a leasehold header that is missing or malformed.
type StampError struct {
	Header string // the header name
	Value  string // the offending value, empty when missing
	Err    error  // what is wrong with it
}

func (e *StampError) Error() string {
	return fmt.Sprintf("leasehold: header %s: %v: publish effects through a leasehold worker (or stamp them with leasehold.Stamp.SetHeader)", e.Header, e.Err)
}

// Is makes errors.Is(err, ErrBadStamp) true.
func (e *StampError) Is(target error) bool { return target == ErrBadStamp }

// Unwrap returns the parse error.
func (e *StampError) Unwrap() error { return e.Err }
