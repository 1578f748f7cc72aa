package leasehold

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Headers of a job's identity and of a replay. A job keeps its identity for
// life: the idempotency keys of its effects derive from the place where it
// was first stored (its origin), not from where its message sits now, so a
// job replayed from a dead letter, enqueued again on another stream or
// moved to another partition emits the same keys, and a sink that dedupes
// applies each of its effects once. A job that never moved carries no
// origin header: its place is its origin, and its keys are the ones it
// always had.
const (
	// HeaderOrigin is "<scope>/<partition>/<seq>": the job stream (its
	// scope), partition and sequence where the job was first stored. Only
	// leasehold's tools write it; a producer refuses it from a user.
	HeaderOrigin = "Leasehold-Origin"
	// HeaderReplayOf names, on a replayed job or effect, the dead letter it
	// was replayed from: "<dead-letter stream>/<sequence>".
	HeaderReplayOf = "Leasehold-Replay-Of"
	// HeaderReplayReason is, on a replay, the failure that had
	// dead-lettered it: one line of printable text, at most
	// MaxReplayReason bytes.
	HeaderReplayReason = "Leasehold-Replay-Reason"
)

// MaxReplayReason bounds HeaderReplayReason.
const MaxReplayReason = 512

// MaxOriginScopeLen bounds the scope of an origin, so that every key
// derived from it (an effect's, an abort marker's, a dead letter's) fits in
// MaxKeyLen.
const MaxOriginScopeLen = 160

// maxOriginSeq bounds an origin's sequence, as a job mark bounds its job.
const maxOriginSeq = 1 << 63

// Origin is a job's identity: where it was first stored.
type Origin struct {
	Scope     string
	Partition Partition
	Seq       uint64 // the job's sequence in its first job stream, from 1
}

// OriginOf is the origin of a job stored at seq of partition p of the job
// stream of scope, that never moved.
func OriginOf(scope string, p Partition, seq uint64) Origin {
	return Origin{Scope: scope, Partition: p, Seq: seq}
}

// String formats o as HeaderOrigin carries it: "<scope>/<partition>/<seq>".
func (o Origin) String() string {
	return o.Scope + "/" + o.Partition.String() + "/" + strconv.FormatUint(o.Seq, 10)
}

// EffectKey is the idempotency key of the index-th effect of the job: the
// key EffectKey gives at the job's first place.
func (o Origin) EffectKey(index int) string { return EffectKey(o.Scope, o.Partition, o.Seq, index) }

// Validate reports whether o can be written as a header and read back.
func (o Origin) Validate() error {
	_, err := ParseOrigin(o.String())
	return err
}

// SetHeader writes o into h, replacing every spelling of HeaderOrigin
// already there.
func (o Origin) SetHeader(h map[string][]string) {
	for k := range h {
		if strings.EqualFold(k, HeaderOrigin) {
			delete(h, k)
		}
	}
	h[HeaderOrigin] = []string{o.String()}
}

// ErrBadOrigin is matched by the error about a malformed HeaderOrigin.
var ErrBadOrigin = errors.New("leasehold: malformed job origin")

// OriginError reports a HeaderOrigin that cannot be read.
type OriginError struct {
	Value string
	Err   error
}

func (e *OriginError) Error() string {
	return fmt.Sprintf("leasehold: header %s %q: %v: a job's origin is <scope>/<partition>/<seq>, written by leasehold's tools when they replay or move a job",
		HeaderOrigin, e.Value, e.Err)
}

// Is makes errors.Is(err, ErrBadOrigin) true.
func (e *OriginError) Is(target error) bool { return target == ErrBadOrigin }

// Unwrap returns what is wrong.
func (e *OriginError) Unwrap() error { return e.Err }

// ParseOrigin reads an origin, strictly: a valid scope of at most
// MaxOriginScopeLen bytes, then a partition and a sequence in canonical
// decimal (no sign, no leading zero), the sequence from 1. The partition
// and the sequence are the last two '/'-separated fields: a scope may hold
// '/' itself (a lock's does).
func ParseOrigin(s string) (Origin, error) {
	bad := func(err error) (Origin, error) { return Origin{}, &OriginError{Value: s, Err: err} }
	rest, seqs, ok := cutLast(s, '/')
	if !ok {
		return bad(errors.New("has no '/'"))
	}
	scope, parts, ok := cutLast(rest, '/')
	if !ok {
		return bad(errors.New("names no scope"))
	}
	if err := ValidateScope(scope); err != nil {
		return bad(err)
	}
	if len(scope) > MaxOriginScopeLen {
		return bad(fmt.Errorf("its scope is %d bytes long; the limit is %d", len(scope), MaxOriginScopeLen))
	}
	p, err := ParsePartition(parts)
	if err != nil {
		return bad(err)
	}
	seq, err := parseCanonical(seqs, maxOriginSeq)
	if err != nil {
		return bad(fmt.Errorf("sequence %q: %w", seqs, err))
	}
	if seq == 0 {
		return bad(errors.New("sequence is zero, and sequences start at 1"))
	}
	return Origin{Scope: scope, Partition: p, Seq: seq}, nil
}

func cutLast(s string, sep byte) (before, after string, found bool) {
	i := strings.LastIndexByte(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}

// OriginFromHeader reads HeaderOrigin from message headers. Names match
// without regard to case; the header given more than once with different
// values is an error, as is a value ParseOrigin refuses. ok is false when
// the headers carry no origin: the job has never moved.
func OriginFromHeader(h map[string][]string) (o Origin, ok bool, err error) {
	var v string
	n := 0
	for k, vs := range h {
		if len(k) != len(HeaderOrigin) || !strings.EqualFold(k, HeaderOrigin) {
			continue
		}
		for _, x := range vs {
			if n > 0 && x != v {
				return Origin{}, false, &OriginError{Value: x, Err: errConflict}
			}
			v, n = x, n+1
		}
	}
	if n == 0 {
		return Origin{}, false, nil
	}
	o, err = ParseOrigin(v)
	if err != nil {
		return Origin{}, false, err
	}
	return o, true, nil
}
