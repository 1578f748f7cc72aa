package worker

import (
	"fmt"

	"github.com/leasehold/leasehold"
)

// A job keeps its identity for life. The keys of its effects, the keys of
// its abort markers and what its dead letter says it is derive from its
// origin: the place where it was first stored. A job that never moved is
// its own origin, and its keys are leasehold.EffectKey(scope, partition,
// seq, index) as they always were; a job that `leasehold dlq replay` (or
// another of leasehold's tools) stored again carries its origin in
// leasehold.HeaderOrigin, and emits the keys it emitted at its first place.
// So a replay, or a move, of a job whose effects were applied in part is
// applied once by every sink that dedupes by key.
//
// Only leasehold's tools write the header: a Producer refuses it. Anyone
// who may publish on a job subject can still write it by hand, and a job
// with a forged origin emits another job's keys: a sink that dedupes drops
// whichever of the two comes second. That is the power such a publisher
// has already over the jobs it writes (it chooses their data); what the
// header adds is that it can pre-empt the effects of a job it did not
// write, or have its own dropped. Keep job subjects to trusted publishers.

// Origin is the job's identity: the scope, partition and sequence where it
// was first stored. For a job that never moved, that is its own place.
func (j *Job) Origin() leasehold.Origin {
	o, _ := j.identity()
	return o
}

// identity reads the job's origin once. A header that cannot be read is a
// permanent failure: the job is dead-lettered saying why, not run under
// keys of its place, which would apply again effects it applied at its
// origin. Its origin is then its place, for the dead letter.
func (j *Job) identity() (leasehold.Origin, error) {
	j.originOnce.Do(func() {
		j.origin = leasehold.OriginOf(j.Lease.Scope, j.Partition, j.Seq)
		o, ok, err := leasehold.OriginFromHeader(j.Header)
		switch {
		case err != nil:
			j.originErr = Permanent(fmt.Errorf("job %d of partition %d: %w", j.Seq, j.Partition, err))
		case ok:
			j.origin = o
		}
	})
	return j.origin, j.originErr
}

// beforeHandle refuses, before any handler runs, a job that cannot be run:
// one whose origin cannot be read, or a roll-up or a schedule stored on a
// partition subject (see rollupError).
func beforeHandle(job *Job) error {
	if _, err := job.identity(); err != nil {
		return err
	}
	return rollupError(job)
}

// originOf is the origin of the job stored at seq of the runner's
// partition with headers h: its own place unless h carries a readable
// origin.
func (r *runner) originOf(h map[string][]string, seq uint64) leasehold.Origin {
	if o, ok, err := leasehold.OriginFromHeader(h); ok && err == nil {
		return o
	}
	return leasehold.OriginOf(r.info.Scope, r.p, seq)
}
