package sink

import (
	"context"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// Progress is what a partition's fence record says of its committed input:
// the acquisition that can still commit, and what was committed (see
// coordinator.Committed).
type Progress = coordinator.Committed

// ProgressReader reads a fence's committed progress from its fence record.
// *coordinator.Bucket satisfies it for the scopes it serves. A sink that
// holds a job's effects back until the job completes (the stream sink
// runner) asks it when an attempt of a job has stopped coming, so that
// only proof closes an attempt, never a marker on its own.
type ProgressReader interface {
	Committed(ctx context.Context, id leasehold.FenceID) (Progress, error)
}

// Settled reports whether p shows that the lease (epoch, acquisition) of
// p's fence will commit no more of job: another acquisition has fenced the
// record since (a commit is a compare-and-set on the record), or the lease
// committed the job. A worker commits a job only once the log has
// acknowledged every effect of the job's completed attempt, so a sink that
// read p, then noted the last position of its effect log, and has decided
// the log up to that position, has seen every effect of job that the
// lease's worker can commit: an attempt of job it holds incomplete then
// never completes, and one that starts after that position is not the
// worker's.
//
// A record that has not seen the lease yet (a lower epoch, or none) says
// nothing of it.
func Settled(p Progress, epoch leasehold.Epoch, acquisition string, job uint64) bool {
	switch {
	case p.Epoch == 0 || p.Epoch < epoch:
		return false
	case p.Epoch > epoch:
		return true
	case p.Acquisition != acquisition:
		// The same epoch fenced by another acquisition: the lease bucket
		// handed one revision out twice, and the record refuses this one.
		// A record that names no acquisition was written by a release that
		// kept none, and says nothing.
		return p.Acquisition != ""
	}
	return p.Includes(job)
}
