package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
)

// FindingKind names what is wrong with a record.
type FindingKind string

// What Findings reports. Every input from the network is untrusted: these
// are the records a client with write access to the buckets can leave that
// leasehold itself never writes.
const (
	// FindingForeign: a partition, lock or member key holds a value that is
	// not a lease: it does not decode, or carries no per-message TTL (the
	// server would never expire it), or a TTL other than the one it names.
	// Such a record holds its partition or lock for ever, and a member
	// record inflates the worker count.
	FindingForeign FindingKind = "foreign-record"
	// FindingGarbledFence: a fence record does not decode, so its
	// partition or lock cannot be acquired.
	FindingGarbledFence FindingKind = "garbled-fence-record"
	// FindingEpochAhead: a fence record claims an epoch above every
	// revision the lease bucket has issued: it was forged, or the lease
	// bucket lost writes. Acquisitions of its partition or lock are
	// refused until it is repaired.
	FindingEpochAhead FindingKind = "epoch-ahead"
	// FindingProgressAhead: a partition's progress is beyond its job
	// stream's last sequence, so the jobs still to come up to it would be
	// skipped.
	FindingProgressAhead FindingKind = "progress-ahead"
	// FindingLegacyProgress: a progress record in the lease bucket, the
	// way an earlier leasehold kept progress: a worker of that version is
	// still running.
	FindingLegacyProgress FindingKind = "legacy-progress"
	// FindingOutOfRange: a partition record for a partition the job stream
	// does not have.
	FindingOutOfRange FindingKind = "out-of-range"
	// FindingUnknownKey: a key leasehold does not use.
	FindingUnknownKey FindingKind = "unknown-key"
	// FindingListDisagrees: a live registration lists partitions it does
	// not hold (free, or held by another), and was written again more
	// than a lease's length after their records were. A worker lists
	// what it holds within a second of a change, so this one is stuck or
	// not a leasehold worker; either way the worker group counts those
	// partitions as its, and they stay free for as long as it lives.
	FindingListDisagrees FindingKind = "list-disagrees"
)

// Finding is one record that is not what leasehold writes.
type Finding struct {
	Kind     FindingKind        `json:"kind"`
	Bucket   string             `json:"bucket"`
	Key      string             `json:"key"`
	Revision uint64             `json:"revision"`
	Written  time.Time          `json:"written,omitzero"` // the server's time of the write
	Fence    *leasehold.FenceID `json:"fence,omitempty"`  // the partition or lock it concerns
	Problem  string             `json:"problem"`
	Fix      string             `json:"fix"`
}

func (f Finding) String() string {
	return fmt.Sprintf("%s: %s of bucket %s (revision %d): %s; %s", f.Kind, f.Key, f.Bucket, f.Revision, f.Problem, f.Fix)
}

// Findings reads both buckets and returns the records that are not
// leasehold's, or claim what cannot be, with what to do about each; nil
// when all is well. It is Snapshot's Findings.
func (b *Bucket) Findings(ctx context.Context) ([]Finding, error) {
	st, err := b.Snapshot(ctx)
	return st.Findings, err
}

func (f Finding) foreign(reason, effect string) Finding {
	f.Kind, f.Problem, f.Fix = FindingForeign, "not a lease leasehold wrote: "+reason+"; "+effect, repairHint(f.Key)
	return f
}

func (f Finding) garbledFence(err error) Finding {
	f.Kind, f.Problem, f.Fix = FindingGarbledFence, err.Error()+"; nobody can acquire it", fenceFix(f.Key)
	return f
}

func (f Finding) epochAhead(claimed, last uint64) Finding {
	f.Kind = FindingEpochAhead
	f.Problem = fmt.Sprintf("claims epoch %d, above every revision the lease bucket has issued (%d): it was forged, or the lease bucket lost writes; acquisitions are refused", claimed, last)
	f.Fix = fenceFix(f.Key) + " under a new epoch; if the lease bucket was restored from a copy, re-create it with an epoch floor instead"
	return f
}

func (f Finding) progressAhead(seq, last uint64) Finding {
	f.Kind = FindingProgressAhead
	f.Problem = fmt.Sprintf("progress %d is beyond the job stream's last sequence %d: jobs up to %d would be skipped when they arrive", seq, last, seq)
	f.Fix = "`leasehold fence " + strings.TrimPrefix(f.Key, partitionKeyPrefix) + "` lowers it to the job stream's last sequence"
	return f
}

func (f Finding) legacyProgress(fences string) Finding {
	f.Kind = FindingLegacyProgress
	f.Problem = "a progress record in the lease bucket, written by a worker of a leasehold that predates the fence-record bucket " + fences
	f.Fix = "stop the workers of the earlier version; `leasehold fence --repair` (Coordinator.Repair) moves the record"
	return f
}

func (f Finding) outOfRange(p leasehold.Partition, n int) Finding {
	f.Kind = FindingOutOfRange
	f.Problem = fmt.Sprintf("partition %d is outside the job stream's %d partitions", p, n)
	f.Fix = "remove it if it is not yours (`nats kv del " + f.Bucket + " " + f.Key + "`)"
	return f
}

func (f Finding) listDisagrees(id string, ps []string) Finding {
	f.Kind = FindingListDisagrees
	f.Problem = fmt.Sprintf("registration %s lists %s, and was renewed more than a lease's length after their records were written; the worker group gives its share to a member that does not take it", id, strings.Join(ps, ", "))
	f.Fix = "stop worker " + id + " if it is stuck; if it is not a leasehold worker, stop what writes its record and remove it (`nats kv del " + f.Bucket + " " + f.Key + "`)"
	return f
}

func (f Finding) unknownKey() Finding {
	f.Kind, f.Problem, f.Fix = FindingUnknownKey, "not a key leasehold uses", "remove it if it is not yours"
	return f
}

// Repair puts right what finding f reports, as its Fix says: it fences the
// partition or lock (which removes a foreign lease record, rewrites a bad
// fence record and lowers progress beyond the job stream), removes a
// foreign member record by a revision-checked purge, or moves a progress
// record an earlier leasehold wrote. Keys leasehold does not use are left
// alone.
func (c *Coordinator) Repair(ctx context.Context, f Finding) (FenceResult, error) {
	switch f.Kind {
	case FindingLegacyProgress:
		p, err := leasehold.ParsePartition(strings.TrimPrefix(f.Key, progressKeyPrefix))
		if err != nil {
			return FenceResult{}, fmt.Errorf("coordinator: repair %s: %w", f.Key, err)
		}
		e, err := c.b.last(ctx, f.Key)
		if err != nil {
			return FenceResult{}, fmt.Errorf("coordinator: repair %s: %w", f.Key, err)
		}
		if e.kind != entryValue || isMoved(e.data) {
			return FenceResult{}, nil
		}
		m := &migrator{js: c.b.js, bucket: c.b.name, fences: c.b.fenceName, leader: c.b.leader, fenceLeader: c.b.fenceLeader}
		if err := m.moveOne(ctx, p, e.rev, e.data); err != nil {
			return FenceResult{}, err
		}
		return FenceResult{Repaired: []string{"moved " + f.Key + " to the fence-record bucket " + c.b.fenceName}}, nil
	case FindingUnknownKey, FindingOutOfRange, FindingListDisagrees:
		return FenceResult{}, fmt.Errorf("coordinator: repair %s: leasehold does not use this key and leaves it alone: %s", f.Key, f.Fix)
	}
	if f.Bucket == c.b.name && f.Kind == FindingForeign && (strings.HasPrefix(f.Key, memberKeyPrefix) || f.Fence == nil) {
		if err := c.b.purge(ctx, f.Key, f.Revision, c.b.markerTTL); err != nil {
			if isConflict(err) {
				return FenceResult{}, fmt.Errorf("coordinator: repair %s: it changed since revision %d; look again", f.Key, f.Revision)
			}
			return FenceResult{}, fmt.Errorf("coordinator: repair %s: %w", f.Key, err)
		}
		return FenceResult{Repaired: []string{fmt.Sprintf("removed %s (revision %d)", f.Key, f.Revision)}}, nil
	}
	if f.Fence == nil {
		return FenceResult{}, fmt.Errorf("coordinator: repair %s: nothing to do for a finding of kind %s", f.Key, f.Kind)
	}
	if f.Fence.Scope == c.b.scope {
		return c.Fence(ctx, f.Fence.Partition)
	}
	name, ok := strings.CutPrefix(f.Fence.Scope, c.b.scope+"/")
	if !ok {
		return FenceResult{}, errors.New("coordinator: repair " + f.Key + ": the finding is of another lease bucket")
	}
	return c.FenceLock(ctx, name)
}
