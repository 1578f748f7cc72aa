package coordinator

import (
	"context"
	"errors"
	"fmt"

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
}

// Includes reports whether job (an input sequence) is committed in c. It
// is the one place that says so: progress kept as a watermark today, and
// as a watermark with the jobs finished beyond it, later.
func (c Committed) Includes(job uint64) bool { return job != 0 && job <= c.Seq }

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
		c.Seq = r.Seq
	}
	return c, nil
}
