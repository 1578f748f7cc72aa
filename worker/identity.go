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
//
// One forgery is refused: an origin in the job's own stream and partition
// at or after the job's place. A replay, or any other store again, is made
// from a job stored earlier, so a true origin there comes before the job;
// one that does not names a place that a job still to come will hold (or
// holds), and running under its keys would pre-empt that job's effects at
// a deduping sink. Such a job is dead-lettered saying why, and its dead
// letter names its own place.

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
		j.origin = leasehold.OriginOf(j.r.info.Scope, j.Partition, j.Seq)
		o, ok, err := leasehold.OriginFromHeader(j.Header)
		switch {
		case err != nil:
			j.originErr = Permanent(fmt.Errorf("job %d of partition %d: %w", j.Seq, j.Partition, err))
		case ok:
			if err := originAhead(o, j.origin); err != nil {
				if j.r != nil {
					j.r.log.Warn("a job names an origin at or after its own place; dead-lettered", "seq", j.Seq, "origin", o.String(), "err", err)
				}
				j.originErr = Permanent(fmt.Errorf("job %d of partition %d: %w", j.Seq, j.Partition, err))
				break
			}
			j.origin = o
		}
	})
	return j.origin, j.originErr
}

// originAhead refuses the origin o of a job stored at place when o lies in
// place's stream and partition at or after it: no replay or move stores a
// job before the job it is made from.
func originAhead(o, place leasehold.Origin) error {
	if o.Scope != place.Scope || o.Partition != place.Partition || o.Seq < place.Seq {
		return nil
	}
	return &leasehold.OriginError{Value: o.String(), Err: fmt.Errorf("it names sequence %d of the job's own partition, at or after the job's place (%d): an origin always comes before the job made from it", o.Seq, place.Seq)}
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
// origin that comes before it (see originAhead).
func (r *runner) originOf(h map[string][]string, seq uint64) leasehold.Origin {
	place := leasehold.OriginOf(r.info.Scope, r.p, seq)
	if o, ok, err := leasehold.OriginFromHeader(h); ok && err == nil && originAhead(o, place) == nil {
		return o
	}
	return place
}
