package coordinator

import (
	"context"
	"errors"
	"fmt"

	"github.com/leasehold/leasehold"
)

// FenceResult says what Fence did.
type FenceResult struct {
	Previous leasehold.Lease // the lease Fence removed; zero when the partition was free
	Epoch    leasehold.Epoch // the epoch Fence acquired and released
}

// Fence fences partition p out from whoever holds it now: it removes the
// live lease, if any, with a revision-checked purge, acquires the partition
// (which fences its progress under a new, higher epoch) and releases it.
// Afterwards the former holder's renewals and commits are refused, sinks
// that learn the new epoch refuse its writes, and the worker group gives
// the partition out again with a higher epoch still. It is the operator's
// tool against a suspected zombie; workers never call it.
func (c *Coordinator) Fence(ctx context.Context, p leasehold.Partition) (FenceResult, error) {
	var res FenceResult
	for attempt := 0; attempt < 5; attempt++ {
		l, err := c.Acquire(ctx, p, ManualRenew())
		if err == nil {
			res.Epoch = l.Epoch()
			if err := l.Release(ctx); err != nil {
				return res, fmt.Errorf("coordinator: fence partition %d: acquired epoch %d but the release failed (the lease expires within %v): %w", p, l.Epoch(), c.cfg.TTL, err)
			}
			return res, nil
		}
		var held *HeldError
		if !errors.As(err, &held) {
			if errors.Is(err, ErrHeld) {
				continue // contended: try again
			}
			return res, fmt.Errorf("coordinator: fence partition %d: %w", p, err)
		}
		// Remove exactly the lease that was read, nothing newer.
		e, err := c.b.last(ctx, partitionKey(p))
		if err != nil {
			return res, fmt.Errorf("coordinator: fence partition %d: %w", p, err)
		}
		if e.kind != entryValue {
			continue
		}
		if r, derr := decodeRecord(e.data); derr == nil {
			res.Previous = leasehold.Lease{Partition: p, Epoch: epochOf(r, e.rev), Holder: r.Holder, Acquired: r.Acquired}
		}
		if err := c.b.purge(ctx, partitionKey(p), e.rev, c.b.markerTTL); err != nil && !isConflict(err) {
			return res, fmt.Errorf("coordinator: fence partition %d: remove the lease of %s: %w", p, res.Previous.Holder, err)
		}
	}
	return res, fmt.Errorf("coordinator: fence partition %d: the partition kept changing hands; try again", p)
}
