package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// Job is one job being handled: the message, where it sits, and the lease
// it is handled under. Its methods emit effects stamped with that lease;
// they are safe for concurrent use, but effects are numbered in the order
// they are emitted, so a handler that wants the same idempotency keys on a
// re-run emits in a deterministic order.
type Job struct {
	Data    []byte
	Header  nats.Header
	Subject string
	// Seq is the job's sequence in the job stream: where its message
	// sits now. Its identity, which its effects' keys derive from, is
	// Origin: the same place unless a replay or a move stored it again.
	Seq       uint64
	Partition leasehold.Partition
	// Attempt counts the runs of this job by this worker since it took the
	// partition, from 1; after a hang (see Config.HangGrace) it counts on
	// when this worker takes the partition again. A job re-run after a
	// fail-over starts at 1 again.
	Attempt int
	// Lease is the lease the job is handled under: a copy, to read. The
	// worker stamps the job's effects from its own, which a handler
	// cannot change.
	Lease leasehold.Lease
	ID    string // the job's Nats-Msg-Id
	// Enqueued is when the job stream stored the job.
	Enqueued time.Time

	// The job's identity (see Origin), read once from its headers.
	originOnce sync.Once
	origin     leasehold.Origin
	originErr  error

	r     *runner
	nonce [16]byte // unique to this attempt, hex: its effects' message IDs carry it
	wire  uint64   // the attempt's number on the wire: rises with every attempt of the lease

	// outs are the effects published per subject, in the order the
	// subjects were first used (see output.go). Most attempts publish on
	// one subject: its output lives in first, and only an attempt of many
	// subjects indexes them in a map.
	outs  []subjectOutput
	first [1]subjectOutput
	index map[string]int

	mu     sync.Mutex
	next   int // index of the next effect
	futs   []jetstream.PubAckFuture
	failed error // the first effect that could not be written
	closed bool  // the attempt is over: nothing more may be emitted

	// Room for what most attempts have, one publish and one subject's
	// undo (see finish), without an allocation of their own. The
	// runner's jobRun shares them until the job is done.
	futBuf  [1]jetstream.PubAckFuture
	undoBuf [1]afterUndo

	dog watchdog // the attempt's (hang.go)
}

type jobKey struct{}

// JobFromContext returns the job a handler's context belongs to, or nil.
// Publisher decorators use it to stamp what a handler writes.
func JobFromContext(ctx context.Context) *Job {
	j, _ := ctx.Value(jobKey{}).(*Job)
	return j
}

// ErrJobDone is matched by the error of an emit after the handler returned.
var ErrJobDone = errors.New("worker: the job's handler has returned")

// NextStamp reserves the next effect index and returns its stamp, for
// writes the worker does not make itself (a sink of your own, a database
// row): write the stamp beside the effect and let the destination fence on
// it. It fails with an error matching leasehold.ErrLeaseLost once the lease
// is gone.
func (j *Job) NextStamp() (leasehold.Stamp, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.reserve()
}

// reserve numbers the next effect; j.mu is held.
func (j *Job) reserve() (leasehold.Stamp, error) {
	if err := j.usable(); err != nil {
		return leasehold.Stamp{}, err
	}
	o, err := j.identity()
	if err != nil {
		return leasehold.Stamp{}, err
	}
	idx := j.next
	j.next++
	return j.r.info.Stamp(o.EffectKey(idx)), nil
}

// usable reports why nothing more may be emitted for j; j.mu is held.
func (j *Job) usable() error {
	if j.closed {
		return fmt.Errorf("job %d of partition %d: %w: emit before returning from Handle", j.Seq, j.Partition, ErrJobDone)
	}
	return j.sendable()
}

// sendable reports why j's lease may no longer be written under: the lease
// is lost, its local deadline has passed (checked against the clock now,
// not left to the deadline's timer, which a process frozen past the
// deadline has not run yet when it wakes), or the runner's context ended
// (a drain that ran out of time).
func (j *Job) sendable() error {
	if err := j.r.sendable(); err != nil {
		return j.leaseLost(err)
	}
	return nil
}

// sendable reports why the runner's lease may no longer be written under
// (see Job.sendable).
func (r *runner) sendable() error {
	// An InMemory runner has no lease: its context says when it is lost.
	if r.lease != nil {
		if err := r.lease.Err(); err != nil {
			return err
		}
		if d := r.lease.Deadline(); !time.Now().Before(d) {
			return fmt.Errorf("the lease's local deadline passed %v ago", time.Since(d).Round(time.Millisecond))
		}
	}
	if err := r.ctx.Err(); err != nil {
		return context.Cause(r.ctx)
	}
	return nil
}

func (j *Job) leaseLost(cause error) error {
	if errors.Is(cause, leasehold.ErrLeaseLost) {
		return fmt.Errorf("worker: job %d: %w", j.Seq, cause)
	}
	return fmt.Errorf("worker: job %d: partition %d epoch %d: %w (%w)", j.Seq, j.Partition, j.Lease.Epoch, leasehold.ErrLeaseLost, cause)
}

// fail records that an effect of j could not be written: the attempt fails
// whatever the handler returns.
func (j *Job) fail(err error) {
	j.mu.Lock()
	if j.failed == nil {
		j.failed = err
	}
	j.mu.Unlock()
}

// close ends the attempt and returns its pending publishes and the first
// effect failure.
func (j *Job) close() ([]jetstream.PubAckFuture, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.closed = true
	return j.futs, j.failed
}
