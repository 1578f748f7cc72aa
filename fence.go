package leasehold

import (
	"errors"
	"fmt"
	"strings"
)

// A fence orders the holders of one scope's partition and nothing else. The
// scope of a job stream's partitions is the job stream's prefix; the scope
// of a named lock is "<namespace>/<name>" and its partition is 0. Prefixes
// cannot contain '/', so the two never collide, and a sink shared by any
// number of job streams and locks keeps one fence per FenceID: an effect of
// one scope is never refused, or admitted, because of another's epochs.

// MaxScopeLen bounds a scope, so that it fits in a header, a KV key token
// and an indexed database column.
const MaxScopeLen = 256

// MaxAcquisitionLen bounds an acquisition token.
const MaxAcquisitionLen = 64

// FenceID names one fence: a scope and a partition within it.
type FenceID struct {
	Scope     string
	Partition Partition
}

// String formats id as "<scope>/<partition>".
func (id FenceID) String() string { return id.Scope + "/" + id.Partition.String() }

// LockScope is the scope of the lock on resource name in namespace.
func LockScope(namespace, name string) string { return namespace + "/" + name }

// FenceState is what a sink records for one fence: the highest epoch it has
// accepted, the acquisition that epoch came from, and its holder (for
// messages; never trusted).
type FenceState struct {
	Epoch       Epoch
	Acquisition string
	Holder      string
}

// Verdict is the fence's judgement of one write.
type Verdict int

const (
	// Admit: the write may be applied. Raise says whether the fence moves.
	Admit Verdict = iota + 1
	// Stale: the write's epoch is below the fence's; its writer lost its
	// lease.
	Stale
	// SplitBrain: the write's epoch equals the fence's but comes from
	// another acquisition: two acquisitions were handed one revision (the
	// lease bucket lost acknowledged writes, or was restored from a copy).
	SplitBrain
)

// Judge decides a write stamped s against fence f. Equal epochs from the
// same acquisition are admitted (one holder writes many times); a fence
// that recorded no acquisition (it was raised without one) admits the
// first and remembers it. raise reports whether the fence must become
// (s.Epoch, s.Acquisition, s.Worker).
func Judge(f FenceState, s Stamp) (v Verdict, raise bool) {
	switch {
	case s.Epoch > f.Epoch:
		return Admit, true
	case s.Epoch < f.Epoch:
		return Stale, false
	case f.Acquisition == "":
		return Admit, s.Acquisition != ""
	case f.Acquisition == s.Acquisition:
		return Admit, false
	}
	return SplitBrain, false
}

// Refusal builds the error for a write stamped s that fence f refused with
// verdict v (Stale or SplitBrain).
func Refusal(f FenceState, s Stamp, v Verdict) *StaleEpochError {
	return &StaleEpochError{
		Scope: s.Scope, Partition: s.Partition, Epoch: s.Epoch, Acquisition: s.Acquisition,
		Max: f.Epoch, MaxAcquisition: f.Acquisition, Key: s.Key, Worker: s.Worker, Holder: f.Holder,
		SplitBrain: v == SplitBrain,
	}
}

// ValidateScope reports whether s can be a scope: 1 to MaxScopeLen bytes of
// printable ASCII, no spaces.
func ValidateScope(s string) error {
	switch {
	case s == "":
		return errors.New("scope is empty")
	case len(s) > MaxScopeLen:
		return fmt.Errorf("scope is %d bytes long; the limit is %d", len(s), MaxScopeLen)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f {
			return fmt.Errorf("scope holds the byte %#x: use printable ASCII without spaces", c)
		}
	}
	return nil
}

// ValidateAcquisition reports whether a can be an acquisition token: 1 to
// MaxAcquisitionLen letters, digits, '-' or '_'.
func ValidateAcquisition(a string) error {
	switch {
	case a == "":
		return errors.New("acquisition is empty")
	case len(a) > MaxAcquisitionLen:
		return fmt.Errorf("acquisition is %d bytes long; the limit is %d", len(a), MaxAcquisitionLen)
	}
	for i := 0; i < len(a); i++ {
		c := a[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("acquisition holds %q: use letters, digits, '-' and '_'", c)
		}
	}
	return nil
}

// ValidateLockName reports whether name can name a lock: 1 to 128 bytes of
// printable ASCII, no spaces.
func ValidateLockName(name string) error {
	if name == "" {
		return errors.New("lock name is empty")
	}
	if len(name) > 128 {
		return fmt.Errorf("lock name is %d bytes long; the limit is 128", len(name))
	}
	if strings.IndexFunc(name, func(r rune) bool { return r <= ' ' || r >= 0x7f }) >= 0 {
		return errors.New("lock name must be printable ASCII without spaces")
	}
	return nil
}
