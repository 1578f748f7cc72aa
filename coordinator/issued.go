package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// ErrUnknownFence is matched by the error IssuedEpoch returns for a fence
// the lease bucket issues no epochs for.
var ErrUnknownFence = errors.New("coordinator: the lease bucket issues no epochs for this fence")

// UnknownFenceError reports a fence the lease bucket does not serve: a
// scope other than its own or its locks', a partition outside its job
// stream's partition count, a malformed lock name. It is a verdict on the
// stamp, not a failure to reach the bucket: a sink refuses the write as
// unverified rather than retrying it.
type UnknownFenceError struct {
	Fence  leasehold.FenceID
	Bucket string
	Reason string
}

func (e *UnknownFenceError) Error() string {
	return fmt.Sprintf("coordinator: lease bucket %s issues no epochs for %s: %s", e.Bucket, e.Fence, e.Reason)
}

// Is makes errors.Is(err, ErrUnknownFence) true.
func (e *UnknownFenceError) Is(target error) bool { return target == ErrUnknownFence }

// Unverified reports that the stamp, not the lease bucket, is at fault:
// sinks classify errors with this method as unverified epochs.
func (e *UnknownFenceError) Unverified() bool { return true }

// IssuedEpoch is the highest epoch the lease bucket has issued for fence
// id (a partition of its scope, or one of its locks), derived only from
// revisions the server assigned to the fence's lease key. It is 0 when none
// can be shown.
//
//   - While the key holds a lease (a record that decodes and carries the
//     per-message TTL it names), the answer is that lease's epoch, bounded
//     by the record's own revision: no acquisition can be newer than the
//     write in front of it.
//   - Otherwise the key holds a release or expiry marker, a record that is
//     not a lease, or nothing (a marker expired). Its revision, or with
//     nothing the bucket's last revision, bounds every epoch issued so far,
//     and the answer is the highest epoch of the fence record at or below
//     that bound.
//
// What this guarantees: the answer is never above a revision the server
// assigned to the key (or, for a key holding nothing, to the bucket), so no
// record a client writes, in either bucket, can make it exceed them, and no
// epoch above the answer can fence out a live holder or a later one: a live
// holder's epoch is the answer, and a later one's is a newer revision. What
// a credential that may write the lease bucket can still do: write a
// well-formed lease record (with a TTL) over the key, which is a stolen
// lease, a real acquisition whose revision becomes the answer; and, while no
// lease is live, claim in the fence record any epoch up to the marker's
// revision, which a sink may then accept for the fence, refusing what the
// last holder still had in flight. Sinks catch the first as any other
// take-over; neither can hold a future holder off.
//
// A fence the bucket does not serve returns an *UnknownFenceError
// (matching ErrUnknownFence).
func (b *Bucket) IssuedEpoch(ctx context.Context, id leasehold.FenceID) (leasehold.Epoch, error) {
	key, err := b.keyOf(ctx, id)
	if err != nil {
		return 0, err
	}
	return b.issued(ctx, key)
}

func (b *Bucket) issued(ctx context.Context, key string) (leasehold.Epoch, error) {
	e, err := b.last(ctx, key)
	if err != nil {
		return 0, fmt.Errorf("coordinator: read %s from the leader of bucket %s: %w", key, b.name, err)
	}
	var bound uint64
	switch e.kind {
	case entryValue:
		r, foreign := foreignReason(e.data, e.header)
		if strings.HasPrefix(key, partitionKeyPrefix) {
			r, foreign = partitionReason(e.data, e.header)
		}
		if foreign == "" {
			return epochOf(r, e.rev), nil
		}
		bound = e.rev
	case entryMarker:
		bound = e.rev
	case entryNone:
		if bound, err = b.lastRevision(ctx); err != nil {
			return 0, err
		}
	}
	rec, _, err := b.readFence(ctx, key)
	if errors.Is(err, errGarbledFence) {
		return 0, nil // shows nothing; Findings reports it
	}
	if err != nil {
		return 0, fmt.Errorf("coordinator: read the fence record %s: %w", key, err)
	}
	var best uint64
	for _, v := range append(rec.Recent, rec.Epoch) {
		if v <= bound && v > best {
			best = v
		}
	}
	return leasehold.Epoch(best), nil
}

// lastRevision is the lease bucket's last revision, as its stream leader
// reports it.
func (b *Bucket) lastRevision(ctx context.Context) (uint64, error) {
	s, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		return 0, fmt.Errorf("coordinator: read the last revision of bucket %s: %w", b.name, err)
	}
	return s.CachedInfo().State.LastSeq, nil
}

// keyOf is the lease key of fence id, or an *UnknownFenceError.
func (b *Bucket) keyOf(ctx context.Context, id leasehold.FenceID) (string, error) {
	unknown := func(reason string) error { return &UnknownFenceError{Fence: id, Bucket: b.name, Reason: reason} }
	if id.Scope == b.scope {
		n, err := b.partitionCount(ctx)
		if err != nil {
			var ue *UnknownFenceError
			if errors.As(err, &ue) {
				return "", unknown(ue.Reason)
			}
			return "", err
		}
		if int(id.Partition) >= n {
			return "", unknown(fmt.Sprintf("job stream %s has %d partitions", jobsStream(b.scope), n))
		}
		return partitionKey(id.Partition), nil
	}
	name, ok := strings.CutPrefix(id.Scope, b.scope+"/")
	if !ok {
		return "", unknown(fmt.Sprintf("it serves scope %q and its locks (%q)", b.scope, leasehold.LockScope(b.scope, "<name>")))
	}
	if err := leasehold.ValidateLockName(name); err != nil {
		return "", unknown(err.Error())
	}
	if id.Partition != 0 {
		return "", unknown("a lock's only partition is 0")
	}
	return lockKey(name), nil
}

// Job stream facts the bucket reads: the partition count is recorded in
// the job stream's metadata and never changes.
const metaPartitions = "leasehold.partitions"

func jobsStream(scope string) string { return scope + "-jobs" }

// jobStreamCache keeps the job stream's partition count once known, and a
// missing stream's verdict for a moment, so that a flood of stamps for a
// scope without a job stream costs one lookup a second.
type jobStreamCache struct {
	mu         sync.Mutex
	partitions int
	missing    error
	checked    time.Time
}

const missingJobsRecheck = time.Second

// partitionCount is the partition count of the bucket's job stream, or an
// *UnknownFenceError when there is no job stream to say.
func (b *Bucket) partitionCount(ctx context.Context) (int, error) {
	c := &b.jobs
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.partitions > 0 {
		return c.partitions, nil
	}
	if c.missing != nil && time.Since(c.checked) < missingJobsRecheck {
		return 0, c.missing
	}
	name := jobsStream(b.scope)
	s, err := b.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		c.missing, c.checked = &UnknownFenceError{Bucket: b.name, Reason: "there is no job stream " + name + " to say how many partitions the scope has"}, time.Now()
		return 0, c.missing
	}
	if err != nil {
		return 0, fmt.Errorf("coordinator: look up job stream %s: %w", name, err)
	}
	v := s.CachedInfo().Config.Metadata[metaPartitions]
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > leasehold.MaxPartitions {
		c.missing, c.checked = &UnknownFenceError{Bucket: b.name, Reason: fmt.Sprintf("job stream %s records no partition count (metadata %s=%q)", name, metaPartitions, v)}, time.Now()
		return 0, c.missing
	}
	c.partitions, c.missing = n, nil
	return n, nil
}
