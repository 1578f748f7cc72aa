package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/leasehold/leasehold"
)

// Committed is what a fence record says of its fence's input progress:
// the acquisition that fenced the record last, which alone can commit
// progress now (a commit is a compare-and-set on the record), and the last
// input sequence committed. The zero value says nothing: the record does
// not exist, or was never fenced.
//
// A worker commits a job only once the log has acknowledged every effect
// the job's completed attempt published, its finals included. So a sink
// that reads this record, then notes how far its effect log reaches, and
// has read the log up to there, holds every effect of each job the record
// says was committed.
type Committed struct {
	Epoch       leasehold.Epoch // the acquisition that fenced the record last
	Acquisition string
	Seq         uint64 // the last input sequence committed (partitions only)
	// Done are the inputs above Seq committed too, ascending: a runner
	// with several jobs in flight finishes them out of order (at most
	// MaxDone; a record of a release before has none).
	Done []uint64
}

// Includes reports whether job (an input sequence) is committed in c: at
// or below the watermark Seq, or among the jobs Done beyond it. It is the
// one place that says so.
func (c Committed) Includes(job uint64) bool {
	if job == 0 {
		return false
	}
	if job <= c.Seq {
		return true
	}
	_, found := slices.BinarySearch(c.Done, job)
	return found
}

// Committed reads the fence record of fence id (a partition of the
// bucket's scope, or one of its locks) through the fence bucket's stream
// leader. A record that does not exist, or that a release or repair left
// as a marker, gives the zero Committed; one that does not decode an
// error matching nothing but what it says, since it can be repaired
// (`leasehold fence`). A fence the bucket does not serve gives an
// *UnknownFenceError (matching ErrUnknownFence).
//
// A read through the leader sees every commit acknowledged before it; a
// record read from anywhere else could be older, which is safe for a sink
// (it learns less) but slower.
func (b *Bucket) Committed(ctx context.Context, id leasehold.FenceID) (Committed, error) {
	key, err := b.keyOf(ctx, id)
	if err != nil {
		return Committed{}, err
	}
	r, _, err := b.readFence(ctx, key)
	if errors.Is(err, errGarbledFence) {
		return Committed{}, fmt.Errorf("coordinator: progress of %s: %w", id, err)
	}
	if err != nil {
		return Committed{}, fmt.Errorf("coordinator: read the fence record %s of %s: %w", key, b.fenceName, err)
	}
	c := Committed{Epoch: leasehold.Epoch(r.Epoch), Acquisition: r.Acquisition}
	if id.Scope == b.scope {
		c.Seq, c.Done = r.Seq, r.done
	}
	return c, nil
}
