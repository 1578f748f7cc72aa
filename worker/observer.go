package worker

import (
	"context"
	"time"

	"github.com/leasehold/leasehold"
)

// EventKind names a worker event.
type EventKind int

// Worker events. A partition sees Acquired, then BarrierWritten for each
// fence and barrier subject, Ready, the job and commit events, and finally
// Revoked then Drained (a hand-off or shutdown) or Lost.
const (
	EventPartitionAcquired EventKind = iota + 1 // the coordinator handed this worker a lease
	EventBarrierWritten                         // a fence was advanced or a barrier published (Subject)
	EventPartitionReady                         // barriers are written; jobs after Seq are consumed
	EventPartitionRevoked                       // the partition is to move: draining starts
	EventPartitionDrained                       // in-flight work finished and progress committed (Duration: drain time)
	EventPartitionLost                          // the lease was lost; the partition's handlers are cancelled (Err)
	EventPartitionStopped                       // a sink refused this worker's epoch (Err); the partition waits for its lease to end
	EventJobStarted                             // an attempt starts (Job, Attempt)
	EventJobFinished                            // an attempt succeeded (Duration)
	EventJobFailed                              // an attempt failed and will be retried (Err, Duration, Backoff)
	EventJobDeadLettered                        // the job's dead letter is stored (Err); progress may move past it
	EventEffectEmitted                          // an effect was published or applied (Stamp, Subject)
	EventProgressCommitted                      // progress through Seq was committed
	EventCommitFailed                           // a commit failed (Err; matches leasehold.ErrLeaseLost when refused)
	EventJobHung                                // the handler did not return after its context ended; the partition is released (Err, Duration)
	EventJobSnoozed                             // the handler snoozed the job: it runs again after Backoff, no attempt counted (Duration)
)

var kindNames = [...]string{
	EventPartitionAcquired: "partition_acquired",
	EventBarrierWritten:    "barrier_written",
	EventPartitionReady:    "partition_ready",
	EventPartitionRevoked:  "partition_revoked",
	EventPartitionDrained:  "partition_drained",
	EventPartitionLost:     "partition_lost",
	EventPartitionStopped:  "partition_stopped",
	EventJobStarted:        "job_started",
	EventJobFinished:       "job_finished",
	EventJobFailed:         "job_failed",
	EventJobDeadLettered:   "job_dead_lettered",
	EventEffectEmitted:     "effect_emitted",
	EventProgressCommitted: "progress_committed",
	EventCommitFailed:      "commit_failed",
	EventJobHung:           "job_hung",
	EventJobSnoozed:        "job_snoozed",
}

func (k EventKind) String() string {
	if k > 0 && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "unknown"
}

// Event describes one thing that happened in a worker. Fields that do not
// apply to the kind are zero.
type Event struct {
	Kind  EventKind
	Lease leasehold.Lease // the partition's lease
	Job   *Job            // job and effect events
	Seq   uint64          // the job's sequence; for partition and commit events, the progress
	// Done is, for ProgressCommitted, the jobs committed as done beyond
	// Seq, ascending: a partition that runs several jobs at once finishes
	// them out of order.
	Done    []uint64
	Attempt int
	// WireAttempt is, for job events, the attempt's number on the wire
	// (the Leasehold-Attempt header of its effects), which rises with
	// every attempt under the lease.
	WireAttempt uint64
	Stamp       leasehold.Stamp // effects and barriers
	Subject     string          // effects and barriers; for fences, "fence"
	Err         error
	// Duration is the attempt's run time for job events, and the drain
	// time for Drained.
	Duration time.Duration
	Backoff  time.Duration // for JobFailed: the wait before the next attempt
	Time     time.Time
}

// Observer receives worker events, for tracing and metrics. It is called
// from the goroutines doing the work: it must be fast, must not block, and
// must be safe for concurrent use. The context is the job's for job and
// effect events (carrying its trace), and the lease's otherwise.
type Observer interface {
	WorkerEvent(ctx context.Context, e Event)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(ctx context.Context, e Event)

// WorkerEvent calls f.
func (f ObserverFunc) WorkerEvent(ctx context.Context, e Event) { f(ctx, e) }
