package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// FenceResult says what Fence did.
type FenceResult struct {
	Previous leasehold.Lease // the lease Fence removed; zero when the partition was free
	Epoch    leasehold.Epoch // the epoch Fence acquired and released
	// Repaired lists what Fence put right on the way: records leasehold
	// did not write that it removed or rewrote, progress it lowered.
	Repaired []string
}

// Fence fences partition p out from whoever holds it now: it removes the
// live lease, if any, with a revision-checked purge, acquires the partition
// (which fences its record under a new, higher epoch) and releases it.
// Afterwards the former holder's renewals and commits are refused, sinks
// that learn the new epoch refuse its writes, and the worker group gives
// the partition out again with a higher epoch still. It is the operator's
// tool against a suspected zombie; workers never call it.
//
// Fence also repairs what would keep the partition from being held: a
// lease key holding a record leasehold did not write (garbage, or no TTL)
// is removed the same way; a fence record that does not decode, or claims
// an epoch the lease bucket never issued, is rewritten (a garbled one loses
// its progress: the partition starts at the job stream's beginning); and
// progress beyond the job stream's last sequence, which would skip the
// jobs still to come, is lowered to it. FenceResult.Repaired says which.
func (c *Coordinator) Fence(ctx context.Context, p leasehold.Partition) (FenceResult, error) {
	return c.fence(ctx, partitionTarget(p))
}

// FenceLock is Fence for the lock on resource name.
func (c *Coordinator) FenceLock(ctx context.Context, name string) (FenceResult, error) {
	t, err := lockTarget(name)
	if err != nil {
		return FenceResult{}, err
	}
	return c.fence(ctx, t)
}

func (c *Coordinator) fence(ctx context.Context, t target) (FenceResult, error) {
	var res FenceResult
	if t.kind == kindPartition {
		// A partition the job stream does not have is not fenced into
		// existence. Without a job stream there is nothing to check.
		if n, err := c.b.partitionCount(ctx); err == nil && int(t.p) >= n {
			return res, fmt.Errorf("coordinator: fence partition %d: job stream %s has %d partitions", t.p, jobsStream(c.b.scope), n)
		}
	}
	for attempt := 0; attempt < 5; attempt++ {
		l, err := c.acquire(ctx, t, acquireOpts{manual: true, repair: true})
		if err == nil {
			res.Epoch = l.Epoch()
			res.Repaired = append(res.Repaired, l.repaired...)
			if t.kind == kindPartition {
				if err := c.capProgress(ctx, l, &res); err != nil {
					_ = l.Release(ctx)
					return res, fmt.Errorf("coordinator: fence %s: %w", t, err)
				}
			}
			if err := l.Release(ctx); err != nil {
				return res, fmt.Errorf("coordinator: fence %s: acquired epoch %d but the release failed (the lease expires within %v): %w", t, l.Epoch(), c.cfg.TTL, err)
			}
			return res, nil
		}
		var (
			held    *HeldError
			foreign *ForeignRecordError
		)
		switch {
		case errors.As(err, &foreign):
			if err := c.b.purge(ctx, t.key, foreign.Revision, c.b.markerTTL); err != nil && !isConflict(err) {
				return res, fmt.Errorf("coordinator: fence %s: remove %s: %w", t, t.key, err)
			}
			res.Repaired = append(res.Repaired, fmt.Sprintf("removed %s (revision %d), not a lease leasehold wrote: %s", t.key, foreign.Revision, foreign.Reason))
		case errors.As(err, &held):
			// Remove exactly the lease that was read, nothing newer.
			e, err := c.b.last(ctx, t.key)
			if err != nil {
				return res, fmt.Errorf("coordinator: fence %s: %w", t, err)
			}
			if e.kind != entryValue {
				continue
			}
			r, derr := decodeRecord(e.data)
			if derr == nil {
				res.Previous = c.b.leaseOf(t, r, e.rev)
			}
			if err := c.b.purge(ctx, t.key, e.rev, c.b.markerTTL); err != nil && !isConflict(err) {
				return res, fmt.Errorf("coordinator: fence %s: remove the lease of %s: %w", t, res.Previous.Holder, err)
			}
			if derr == nil && r.Session != 0 && t.kind == kindPartition {
				c.notify(ctx, r.Holder, t.p, res.Previous.Epoch)
			}
		case errors.Is(err, ErrHeld):
			// contended: try again
		default:
			return res, fmt.Errorf("coordinator: fence %s: %w", t, err)
		}
	}
	return res, fmt.Errorf("coordinator: fence %s: it kept changing hands; try again", t)
}

// capProgress lowers l's progress to its job stream's last sequence when
// it is beyond it: jobs that arrive later would otherwise be skipped.
func (c *Coordinator) capProgress(ctx context.Context, l *Lease, res *FenceResult) error {
	s, err := c.b.js.Stream(ctx, jobsStream(c.b.scope))
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("look up job stream %s: %w", jobsStream(c.b.scope), err)
	}
	last := s.CachedInfo().State.LastSeq
	l.pmu.Lock()
	defer l.pmu.Unlock()
	seq := l.fenced.Seq
	if seq <= last {
		return nil
	}
	if err := l.setProgress(ctx, last); err != nil {
		return err
	}
	res.Repaired = append(res.Repaired, fmt.Sprintf("lowered the progress of partition %d from %d to %d, the job stream's last sequence", l.info.Partition, seq, last))
	return nil
}

// repairHint says how to repair the record at key of the lease bucket.
func repairHint(key string) string {
	switch {
	case strings.HasPrefix(key, partitionKeyPrefix):
		return "`leasehold fence " + strings.TrimPrefix(key, partitionKeyPrefix) + "` (Coordinator.Fence) repairs it and fences the partition; a worker group also takes the partition over once the record has stayed unchanged for a TTL"
	case strings.HasPrefix(key, lockKeyPrefix):
		name, err := decodeLockName(strings.TrimPrefix(key, lockKeyPrefix))
		if err != nil {
			name = strings.TrimPrefix(key, lockKeyPrefix)
		}
		return "`leasehold fence --lock " + name + "` (Coordinator.FenceLock) repairs it and fences the lock"
	case strings.HasPrefix(key, memberKeyPrefix):
		return "`leasehold fence --repair` (Coordinator.Repair) removes it; worker groups ignore it once it has stayed unchanged for a TTL"
	}
	return "remove it if it is not yours"
}
