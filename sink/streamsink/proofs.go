package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"sync"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// An open attempt is dropped only on proof that it can no longer complete:
// its job applied from another attempt, a later lease's stamp admitted on
// its fence (abandon), or its partition's committed progress. The last is
// read here, and it is also what raises a chain's floor (chains.go): once
// the runner has decided the log up to S, every job of the lease at or
// below the record's watermark is finished, and any effect of it to come
// is no worker's, so the floor rises to the watermark, but not to an open
// job of the lease on the chain, which may still apply.
//
// A worker commits a job only once the log has acknowledged every final
// of the job's completed attempt. So when the runner reads a fence record
// and only then notes the log's last position S, every final the lease
// that ran a job could still commit it on is at or below S if the record
// shows the job committed by that lease, or shows another lease (which
// the lease's commits can no longer pass: a commit is a compare-and-set on
// the record). Once the runner has decided the log up to S, an attempt of
// such a job that it holds incomplete never completes (it is dropped), and
// one that first appears after S is not the worker's (SuspectAfterCommit).
// Reading S first would not do: a final stored after it, and committed
// before the record is read, would be missed.
//
// The runner reads the records only while it holds open groups, or chains
// hold jobs applied above their floors, at most once every pollEvery
// (every pollSoon when the held effects near their bounds, the chains
// hold many jobs above their floors, or an abort marker came: the job's
// next attempt waits for the record), each round bounded by
// Config.RequestTimeout, the records of at most pollFences fences: those
// whose groups hold the saved position back the furthest, then those whose
// chains hold jobs above their floors. A failed round is tried again on the next; one that keeps
// failing is logged, and shows in Ready once it has failed for
// Config.StallAfter with groups waiting.

const (
	pollEvery   = time.Second
	pollSoon    = 100 * time.Millisecond
	pollFences  = 256
	pollReaders = 8
)

// proofs is what the runner learned from the fence records.
type proofs struct {
	reader sink.ProgressReader
	// known holds, per fence, the record read and the log position S it
	// covers, once the runner has decided the log up to S.
	known map[leasehold.FenceID]proof
	// pending is a round read and not yet applied: the runner has not
	// decided the log up to pendingAt.
	pending   map[leasehold.FenceID]sink.Progress
	pendingAt uint64
	// unserved are fences the reader says it does not serve: their
	// markers are trusted, as without a reader.
	unserved map[leasehold.FenceID]bool
	last     time.Time // the last round
	round    uint64    // rounds so far
	soon     bool      // read at the next round, every fence waiting

	// Read by Ready, under Runner.mu.
	failingSince time.Time
	lastErr      error
	logged       time.Time
}

type proof struct {
	p  sink.Progress
	at uint64
}

func newProofs(reader sink.ProgressReader) *proofs {
	if reader == nil {
		return nil
	}
	return &proofs{reader: reader, known: map[leasehold.FenceID]proof{}, unserved: map[leasehold.FenceID]bool{}}
}

// proven reports whether the markers of fence id prove nothing on their
// own: a progress reader serves it.
func (r *Runner) proven(id leasehold.FenceID) bool {
	return r.proofs != nil && (len(r.proofs.unserved) == 0 || !r.proofs.unserved[id])
}

// settledJob reports whether the records read show that k's lease commits
// no more of k's job, and the runner has read everything it could commit.
func (r *Runner) settledJob(k groupKey) bool {
	if r.proofs == nil || len(r.proofs.known) == 0 {
		return false
	}
	pr, ok := r.proofs.known[k.fence]
	return ok && sink.Settled(pr.p, k.epoch, k.acquisition, k.job)
}

// afterCommit reports whether an attempt of k's job that first appears at
// log position pos cannot be the worker's: its lease commits no more of
// the job, and everything it could commit is at or below a position the
// runner had decided before.
func (r *Runner) afterCommit(k groupKey, pos uint64) bool {
	if r.proofs == nil || len(r.proofs.known) == 0 {
		return false
	}
	pr, ok := r.proofs.known[k.fence]
	return ok && pos > pr.at && sink.Settled(pr.p, k.epoch, k.acquisition, k.job)
}

// nearLimit notes that the held effects near their bounds: the records are
// read sooner.
func (r *Runner) nearLimit() {
	gs := r.groups
	if r.proofs != nil && (2*gs.held >= r.cfg.MaxHeldEffects || 2*gs.bytes >= r.cfg.MaxHeldBytes) {
		r.proofs.soon = true
	}
}

// poll reads the fence records of the fences whose open groups wait, when
// a round is due, and keeps what it read until the runner has decided the
// log up to where it then ended. It runs on Run's goroutine, between
// batches.
func (r *Runner) poll(ctx context.Context) {
	pr := r.proofs
	if pr == nil || pr.pending != nil || len(r.groups.open) == 0 && r.groups.above == 0 {
		return
	}
	r.nearLimit()
	if r.groups.crowded {
		pr.soon, r.groups.crowded = true, false
	}
	since := time.Since(pr.last)
	if since < pollEvery && !(pr.soon && since >= pollSoon) {
		return
	}
	// A group that opened since the last round most likely completes in
	// a moment, as a job's effects do: it waits a round, unless something
	// asks for the records sooner.
	all := pr.soon
	pr.last, pr.soon = time.Now(), false
	pr.round++
	fences := r.waitingFences(all)
	if len(fences) == 0 {
		return
	}
	read, err := r.readProgress(ctx, fences)
	var end uint64
	if err == nil {
		// Only after the records: see above.
		state, serr := r.logState(ctx, false)
		err, end = serr, state.LastSeq
	}
	r.mu.Lock()
	if err != nil {
		if pr.failingSince.IsZero() {
			pr.failingSince = time.Now()
		}
		pr.lastErr = err
	} else {
		pr.failingSince, pr.lastErr = time.Time{}, nil
	}
	failing := pr.failingSince
	r.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil && time.Since(pr.logged) >= 10*pollEvery {
			pr.logged = time.Now()
			r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: cannot read committed progress from the fence records; attempts of jobs wait until it can",
				slog.String("sink", r.cfg.Name), slog.Int("fences", len(fences)), slog.Duration("failing_for", time.Since(failing).Round(time.Second)),
				slog.Int("held", r.groups.held), slog.Any("error", err))
		}
		return
	}
	pr.pending, pr.pendingAt = read, end
}

// waitingFences lists the fences of the open groups (with all, or else
// of those open since before this round), those holding the saved
// position back the furthest first, then those of chains holding jobs
// above their floors, at most pollFences.
func (r *Runner) waitingFences(all bool) []leasehold.FenceID {
	first := map[leasehold.FenceID]uint64{}
	for k, g := range r.groups.open {
		if !r.proven(k.fence) || !all && g.born+1 >= r.proofs.round {
			continue
		}
		if f, ok := first[k.fence]; !ok || g.first != 0 && (f == 0 || g.first < f) {
			first[k.fence] = g.first
		}
	}
	if r.groups.above > 0 {
		for c, a := range r.groups.applied {
			if _, ok := first[c.fence]; !ok && len(a.Above) > 0 && r.proven(c.fence) {
				first[c.fence] = math.MaxUint64
			}
		}
	}
	out := make([]leasehold.FenceID, 0, len(first))
	for id := range first {
		out = append(out, id)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := first[out[i]], first[out[j]]
		if a != b {
			return a < b
		}
		if out[i].Scope != out[j].Scope {
			return out[i].Scope < out[j].Scope
		}
		return out[i].Partition < out[j].Partition
	})
	if len(out) > pollFences {
		out = out[:pollFences]
	}
	return out
}

// readProgress reads the records of fences, a few at once, within
// Config.RequestTimeout in all. A fence the reader says it does not serve
// is noted, and its markers trusted from then on.
func (r *Runner) readProgress(ctx context.Context, fences []leasehold.FenceID) (map[leasehold.FenceID]sink.Progress, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	var (
		mu       sync.Mutex
		wg       sync.WaitGroup
		errs     []error
		out      = make(map[leasehold.FenceID]sink.Progress, len(fences))
		unserved []leasehold.FenceID
		sem      = make(chan struct{}, pollReaders)
	)
	for _, id := range fences {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			p, err := r.proofs.reader.Committed(ctx, id)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				out[id] = p
			case isVerdict(err):
				unserved = append(unserved, id)
			default:
				errs = append(errs, fmt.Errorf("read the committed progress of %s: %w", id, err))
			}
		}()
	}
	wg.Wait()
	for _, id := range unserved {
		if !r.proofs.unserved[id] {
			r.proofs.unserved[id] = true
			r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: the progress reader does not serve this fence: its job markers are trusted as the worker writes them",
				slog.String("sink", r.cfg.Name), slog.String("fence", id.String()))
		}
	}
	return out, errors.Join(errs...)
}

// isVerdict reports whether a reader's error says the fence is not its
// to read (coordinator.UnknownFenceError) rather than that it failed.
func isVerdict(err error) bool {
	var u interface{ Unverified() bool }
	return errors.As(err, &u) && u.Unverified()
}

// applyProofs makes the round read the runner's knowledge once it has
// decided the log up to where the round ended (decided), drops the
// attempts it shows can never complete and applies what that lets apply.
func (r *Runner) applyProofs(decided uint64, outs *[]outcome) bool {
	pr := r.proofs
	if pr == nil || pr.pending == nil || decided < pr.pendingAt {
		return false
	}
	for id, p := range pr.pending {
		pr.known[id] = proof{p: p, at: pr.pendingAt}
	}
	read, at := pr.pending, pr.pendingAt
	pr.pending = nil
	var touched []groupKey
	for k, g := range r.groups.open {
		if _, ok := read[k.fence]; !ok {
			continue
		}
		touched = append(touched, k)
		if !r.settledJob(k) {
			continue
		}
		// An attempt still incomplete never completes; one that first
		// appeared after the round ended is not the worker's.
		for i := 0; i < len(g.atts); {
			if a := g.atts[i]; !a.complete() || a.first > at {
				if a.complete() && len(a.held) > 0 {
					a.held[0].d.Suspect = SuspectAfterCommit
				}
				r.dropAttempt(g, a, outs)
				continue
			}
			i++
		}
		r.keepGroup(k, g)
	}
	// What the drops let apply, chain by chain in job order, and the floors
	// the records prove: raised before, for what waits on a job they pass,
	// and after, for what applied meanwhile.
	raised := r.proveFloors(read, &touched)
	sort.Slice(touched, func(i, j int) bool { return touched[i].job < touched[j].job })
	for _, k := range touched {
		r.applyReady(k, outs)
	}
	raised = r.proveFloors(read, nil) || raised
	r.noteStuck(touched)
	return len(touched) > 0 || raised
}

// noteStuck marks the groups of touched still open whose job the records
// settled: every attempt of the job that its lease could commit is in the
// log, and none applies yet (its After does not hold, or another attempt
// ranks before it). One whose After can never hold stays so: a final
// forged under the holder's stamp before the worker's own can do that.
// Ready fails once the oldest has stayed so for Config.StallAfter, and the
// gauge leasehold_sink_jobs_stuck counts them.
func (r *Runner) noteStuck(touched []groupKey) {
	gs := r.groups
	now := time.Now()
	for _, k := range touched {
		if g := gs.open[k]; g != nil && g.stuck.IsZero() && r.settledJob(k) {
			g.stuck = now
		}
	}
	n, oldest, first := 0, time.Time{}, groupKey{}
	for k, g := range gs.open {
		if g.stuck.IsZero() {
			continue
		}
		n++
		if oldest.IsZero() || g.stuck.Before(oldest) {
			oldest, first = g.stuck, k
		}
	}
	r.mu.Lock()
	r.stuckCount, r.stuckSince, r.stuckFirst = n, oldest, first
	r.mu.Unlock()
}

// stuckStalled returns why Ready fails while a group whose job the records
// settled has stayed open for longer than Config.StallAfter; r.mu is held.
func (r *Runner) stuckStalled() error {
	if r.stuckCount == 0 {
		return nil
	}
	if d := time.Since(r.stuckSince); d > r.cfg.StallAfter {
		k := r.stuckFirst
		return fmt.Errorf("streamsink: sink %s holds %d jobs whose leases the fence records show will commit no more of them, and whose effects cannot apply: job %d of %s (epoch %d, acquisition %s) on %s for %v (Config.StallAfter %v); its final names in Leasehold-After a job that is not applied, or a final forged under the holder's stamp came before the worker's",
			r.cfg.Name, r.stuckCount, k.job, k.fence, k.epoch, k.acquisition, k.subject, d.Round(time.Second), r.cfg.StallAfter)
	}
	return nil
}

// proveFloors raises the floor of every chain of a fence in read whose
// lease the record read shows to the watermark it committed, but to no
// open job of the lease on the chain (see chains.go), and adds to touched
// a group of each lane whose floor rose. The runner has decided the log up
// to where the round ended.
func (r *Runner) proveFloors(read map[leasehold.FenceID]sink.Progress, touched *[]groupKey) bool {
	gs := r.groups
	raised := false
	for c, a := range gs.applied {
		p, ok := read[c.fence]
		if !ok || p.Epoch != a.Epoch || p.Acquisition != a.Acquisition || p.Seq <= a.Floor || !r.proven(c.fence) {
			continue
		}
		f := p.Seq
		lk := laneKey{chainKey: c, epoch: a.Epoch, acquisition: a.Acquisition}
		l := gs.lanes[lk]
		if l != nil && len(l.jobs) > 0 {
			f = min(f, l.jobs[0]-1)
		}
		if f <= a.Floor {
			continue
		}
		gs.store(c, a.prove(f), false)
		raised = true
		if l != nil && len(l.jobs) > 0 && touched != nil {
			*touched = append(*touched, lk.group(l.jobs[0]))
		}
	}
	return raised
}

// resolve applies, in a step that took no message, a round of records the
// runner has decided the log far enough for, and saves what it settled.
func (r *Runner) resolve(ctx context.Context) error {
	if r.proofs == nil || r.proofs.pending == nil || r.seq < r.proofs.pendingAt {
		return nil
	}
	began := time.Now()
	w := &work{seq: r.seq}
	var outs []outcome
	if !r.applyProofs(w.seq, &outs) {
		return nil
	}
	w.grouped = true
	r.startSpans(ctx, outs, began)
	err := r.settle(ctx, outs, w)
	endSpans(outs, err)
	if err != nil {
		r.needReload = true
	}
	return err
}

// progressStalled returns why Ready fails while the records have not been
// read for longer than Config.StallAfter with attempts waiting on them;
// r.mu is held.
func (r *Runner) progressStalled() error {
	pr := r.proofs
	if pr == nil || pr.failingSince.IsZero() || r.heldCount == 0 && r.aboveCount == 0 {
		return nil
	}
	if d := time.Since(pr.failingSince); d > r.cfg.StallAfter {
		return fmt.Errorf("streamsink: sink %s has not read committed progress from the fence records for %v (Config.StallAfter %v), and holds %d effects of jobs waiting on it and %d jobs applied above their chains' floors: %v",
			r.cfg.Name, d.Round(time.Second), r.cfg.StallAfter, r.heldCount, r.aboveCount, pr.lastErr)
	}
	return nil
}
