package streamsink

import (
	"fmt"
	"slices"

	"github.com/leasehold/leasehold"
)

// Where a chain (a fence's effects on one subject) stands in a lease: its
// floor and the jobs applied above it.
//
// A runner with one job of a partition in flight completes its jobs in
// stream order, so the last job applied on a chain was all the chain needed:
// every job at or below it was finished. A runner with several jobs in flight
// completes them out of order, and says how far its jobs are all finished
// with the floor its finals carry (leasehold.HeaderFloor): every job of the
// lease up to the floor is finished, its finals (if any) in the log before
// the final that carries it, and none publishes anything more under the
// lease. So a chain keeps a floor F and the set A of jobs above F it
// applied:
//
//   - the effects of job J are duplicates when J <= F or J is in A;
//   - a complete attempt of J whose final names After applies when After is
//     0, at or below F, or in A (and the rules of attempts.go let it);
//   - applying J adds it to A. What A holds at or below F leaves it.
//
// What raises F depends on whether the fence's committed progress can be
// read (Config.Progress serves it).
//
// With committed progress, F is proven: every job of the lease up to it
// is applied on the chain, or the fence record shows it committed and the
// runner has decided every effect the lease could commit it with, while
// no group of it was open (proofs.go raises F so, and no higher than below
// the lowest open job of the lease on the chain). A final's floor, and for
// a final without one its own job, are claims anyone who can publish on the
// log with the holder's stamp can make: they raise nothing. A forged final
// claiming a floor over jobs still running therefore makes none of them a
// duplicate, nor lets a job whose After names one of them apply first: a
// job counts as applied only once it was, or once the record proves it
// finished. A is what holds the jobs applied between two readings of the
// record, and the runner reads the records of the fences whose chains hold
// jobs above their floors at least once every pollEvery.
//
// Without committed progress (no reader, or a fence it does not serve),
// the worker's markers are trusted as it writes them: applying J raises F
// to its final's floor, or, for a final without one, to J itself (a
// sequential runner's final says that every job up to its own is
// finished, the rule the chain kept before floors). Applying a job whose
// floor passes an open job of the lease on the chain then says that job
// finished without completing here (aborted, dead-lettered, superseded by
// a re-run): it is dropped.
//
// A is bounded by maxAbove, and the gauge leasehold_sink_jobs_above_floor
// counts the jobs the chains hold above their floors. With committed
// progress, a worker commits every worker.Config.CommitEvery (250 ms by
// default), so a chain holds about the jobs of its partition of the last
// second or two. It fills while progress lags: a worker that commits
// rarely, a runner catching up on more than maxAbove jobs of one lease
// (a round of records applies only once the runner has read up to where
// the log ended when it was read), or a forger who publishes finals of
// many jobs to come. At the bound the chain forgets the lowest job of its
// set, counted (leasehold_sink_jobs_forgotten_total) and logged: that job is
// then neither a duplicate nor settled on the chain, so its effects, should
// they come again (a forged copy, or a runner that restarts and reads the
// log again from before them), apply again, which a destination that
// dedupes by key absorbs, and a final naming it in After waits for the
// record. Nothing is dropped, and the runner does not stop: stopping would
// be for good while it catches up. Without committed progress a chain
// holding more than maxAbove stops the runner with ErrGroupLimit before it
// delivers anything more, and Ready says so: there the worker's floors
// keep it small, and one that grows is a worker running more jobs past its
// watermark than it may.

// maxAbove bounds a chain's jobs applied above its floor; a variable for
// tests.
var maxAbove = 1 << 14

// chainKey names the effects of one fence on one subject.
type chainKey struct {
	fence   leasehold.FenceID
	subject string
}

// applied is where a chain stands in a lease (see above). Holes are, of the
// jobs it applied, those whose delivery went to the dead-letter stream, the
// latest maxHoles: they were not applied, and their effects apply on their
// own when they come again (a dead letter replayed).
type applied struct {
	Epoch       leasehold.Epoch
	Acquisition string
	Floor       uint64
	Above       []uint64 // ascending, each above Floor
	Holes       []uint64
	// Origins are, of the jobs it applied, the latest maxOrigins whose
	// applied attempt carried the keys of the job's origin (a replayed
	// job's, see keyNamesOrigin) rather than its own.
	Origins []uint64
	top     uint64 // the highest attempt seen applied in the lease; not saved
}

// done reports whether job's effects on the chain are settled: applied, or
// finished without completing here.
func (a applied) done(job uint64) bool {
	if job <= a.Floor {
		return true
	}
	if len(a.Above) == 0 {
		return false
	}
	_, found := slices.BinarySearch(a.Above, job)
	return found
}

// holds reports whether a final naming after may apply on the chain.
func (a applied) holds(after uint64) bool { return after == 0 || a.done(after) }

// high is the highest job the chain settled.
func (a applied) high() uint64 {
	if n := len(a.Above); n > 0 {
		return a.Above[n-1]
	}
	return a.Floor
}

// floorOf is the floor a chain at a rises to by applying job with final:
// where the worker's markers are trusted, the final's floor, or the job for
// a final without one; where they are not, the floor stays (see above).
func (a applied) floorOf(job uint64, final leasehold.JobMark, trusted bool) uint64 {
	if !trusted {
		return a.Floor
	}
	f := job
	if final.Floors() {
		f = final.Floor
	}
	return max(a.Floor, f)
}

// prove raises a chain at a to the floor f that committed progress proves,
// dropping what its set holds up to it.
func (a applied) prove(f uint64) applied {
	if f <= a.Floor {
		return a
	}
	a.Floor = f
	if n := len(a.Above); n > 0 {
		i, _ := slices.BinarySearch(a.Above, f+1)
		a.Above = slices.Clone(a.Above[i:])
	}
	return a
}

// hole reports whether job's delivery went to the dead-letter stream.
func (a applied) hole(job uint64) bool {
	return slices.Contains(a.Holes, job)
}

// maxHoles bounds the dead-lettered jobs a chain remembers.
const maxHoles = 16

// maxOrigins bounds the jobs applied under their origin's keys a chain
// remembers.
const maxOrigins = 64

// appliedAsOrigin reports whether job was applied under its origin's keys.
func (a applied) appliedAsOrigin(job uint64) bool {
	return slices.Contains(a.Origins, job)
}

// chain returns where k's chain stands in k's lease: nothing applied, when
// it stands in another.
func (gs *groups) chain(k groupKey) applied {
	a, ok := gs.applied[k.chainKey]
	if ok && a.Epoch == k.epoch && a.Acquisition == k.acquisition {
		return a
	}
	return applied{Epoch: k.epoch, Acquisition: k.acquisition}
}

// store makes a the chain's state; trusted says whether its markers are
// (see above).
func (gs *groups) store(c chainKey, a applied, trusted bool) {
	gs.above += len(a.Above) - len(gs.applied[c].Above)
	gs.applied[c], gs.delta[c] = a, a
	if len(a.Above) >= maxAbove/8 {
		gs.crowded = true
	}
	if len(a.Above) > maxAbove && gs.overflow == nil && trusted {
		gs.overflow = fmt.Errorf("%w: %d jobs of lease %d/%s are applied out of order on subject %s of %s, above its floor %d (at most %d): a worker ran more jobs of the partition past its watermark than it may; lower its MaxInFlight and PartitionConcurrency, or see that its finals carry Leasehold-Floor",
			ErrGroupLimit, len(a.Above), a.Epoch, a.Acquisition, c.subject, c.fence, a.Floor, maxAbove)
	}
}

// forgetChain drops chain c.
func (gs *groups) forgetChain(c chainKey) {
	gs.above -= len(gs.applied[c].Above)
	delete(gs.applied, c)
}

// advance records job k applied, in a chain that stood at a in k's lease,
// from an attempt numbered up to top whose final is final, and whose keys
// were its origin's when asOrigin; trusted says whether the final's floor
// counts (see above).
func (gs *groups) advance(k groupKey, a applied, final leasehold.JobMark, top uint64, asOrigin, trusted bool) {
	if asOrigin && !a.appliedAsOrigin(k.job) {
		origins := make([]uint64, 0, len(a.Origins)+1)
		origins = append(origins, a.Origins...)
		if len(origins) == maxOrigins {
			origins = origins[1:]
		}
		a.Origins = append(origins, k.job)
	}
	if f := a.floorOf(k.job, final, trusted); f > a.Floor {
		a.Floor = f
		if n := len(a.Above); n > 0 {
			// What the floor passed leaves the set; the rest moves to the
			// front, so that the set keeps its room.
			i, _ := slices.BinarySearch(a.Above, f+1)
			a.Above = a.Above[:copy(a.Above, a.Above[i:])]
		}
	}
	if k.job > a.Floor {
		i, found := slices.BinarySearch(a.Above, k.job)
		if !found {
			a.Above = slices.Insert(a.Above, i, k.job)
		}
	}
	if !trusted && len(a.Above) > maxAbove {
		a = a.forgetLowest()
		gs.forgot++
	}
	a.top = max(a.top, top)
	gs.store(k.chainKey, a, trusted)
}

// forgetLowest forgets the lowest job of a's set (see above), and its
// dead letters and origin.
func (a applied) forgetLowest() applied {
	job := a.Above[0]
	a.Above = a.Above[:copy(a.Above, a.Above[1:])]
	if slices.Contains(a.Holes, job) {
		a.Holes = slices.DeleteFunc(slices.Clone(a.Holes), func(j uint64) bool { return j == job })
	}
	if slices.Contains(a.Origins, job) {
		a.Origins = slices.DeleteFunc(slices.Clone(a.Origins), func(j uint64) bool { return j == job })
	}
	return a
}

// addHole records that job k's delivery went to the dead-letter stream.
// It returns the job it forgot to make room, or 0.
func (gs *groups) addHole(k groupKey) uint64 {
	a := gs.chain(k)
	if !a.done(k.job) || a.hole(k.job) {
		return 0 // a later lease's, or known
	}
	var forgot uint64
	holes := make([]uint64, 0, len(a.Holes)+1)
	holes = append(holes, a.Holes...)
	if len(holes) == maxHoles {
		forgot, holes = holes[0], holes[1:]
	}
	a.Holes = append(holes, k.job)
	gs.store(k.chainKey, a, true)
	return forgot
}
