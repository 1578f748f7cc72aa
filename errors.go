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

// StaleEpochError reports a refused write: its epoch is below the
// partition's recorded maximum.
type StaleEpochError struct {
	Partition Partition
	Epoch     Epoch // the epoch the write carried
	Max       Epoch // the highest epoch accepted for the partition
	Key       string
	Worker    string // the writer, when the stamp named it
	Holder    string // the current holder, when known
}

func (e *StaleEpochError) Error() string {
	who := "this worker"
	if e.Worker != "" {
		who = "worker " + e.Worker
	}
	msg := fmt.Sprintf("leasehold: partition %d: epoch %d is below the recorded %d: %s lost its lease and the write was not applied",
		e.Partition, e.Epoch, e.Max, who)
	if e.Holder != "" {
		msg += " (the partition is held by " + e.Holder + ")"
	}
	return msg
}

// Is makes errors.Is(err, ErrStaleEpoch) true.
func (e *StaleEpochError) Is(target error) bool { return target == ErrStaleEpoch }

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
