package chaos

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
)

// attemptKey names one attempt of one job under one epoch.
type attemptKey struct {
	p        leasehold.Partition
	epoch    leasehold.Epoch
	job, try uint64
}

// checkAttempts: no effect of a job that did not complete is applied. An
// attempt completed when its effects are marked final in the log, which the
// worker does only once the handler has returned nil; it failed when its
// worker recorded so (a KindAttempt event) or an abort marker closed it. A
// worker's record of completion is not enough: a final that never reached
// the log leaves the attempt incomplete, and none of its effects may apply.
// Each value in the sink that came from job effects must have come from a
// completed attempt of the job under the value's epoch.
func (c *checker) checkAttempts() {
	done := map[attemptKey]bool{}
	c.done = done
	failed := map[attemptKey]bool{}
	for _, e := range c.in.Events {
		if e.Kind != KindAttempt || e.Outcome == history.AttemptCompleted {
			continue
		}
		failed[attemptKey{leasehold.Partition(e.Partition), leasehold.Epoch(e.Epoch), e.Seq, e.Attempt}] = true
	}
	for _, l := range c.in.Log {
		if l.BadStamp || l.Mark.Standalone() {
			continue
		}
		if _, forged := c.injected[l.Position]; forged {
			continue // a forged final completes nothing, a forged abort fails nothing
		}
		k := attemptKey{l.Stamp.Partition, l.Stamp.Epoch, l.Mark.Job, l.Mark.Attempt}
		switch {
		case l.Mark.Final():
			done[k] = true
		case l.Mark.Abort:
			failed[k] = true
		}
	}
	c.out.AttemptsCompleted = len(done)
	for k := range failed {
		if !done[k] {
			c.out.AttemptsFailed++
		}
	}
	for key, st := range c.in.Final {
		if c.injKeys[key] || c.in.Forged[key] != "" {
			continue
		}
		var tries []string
		ok := false
		entries := c.realEntries(key, st.Epoch)
		// Where the runner says which entry it applied, that entry's
		// attempt is the one judged: another attempt of the job that
		// completed does not excuse it.
		var accepted []int
		for _, i := range entries {
			if d, ok := c.decided[c.in.Log[i].Position]; ok && d.Outcome == "accepted" {
				accepted = append(accepted, i)
			}
		}
		if len(accepted) > 0 {
			entries = accepted
		}
		for _, i := range entries {
			l := c.in.Log[i]
			if l.Mark.Standalone() || l.BadMark {
				ok = true // it stands alone: no job to complete
				break
			}
			k := attemptKey{l.Stamp.Partition, l.Stamp.Epoch, l.Mark.Job, l.Mark.Attempt}
			if done[k] {
				ok = true
				break
			}
			state := "never marked final"
			if failed[k] {
				state = "aborted"
			}
			tries = append(tries, fmt.Sprintf("attempt %d at log position %d: %s", l.Mark.Attempt, l.Position, state))
		}
		if !ok && len(tries) > 0 {
			c.violate(Violation{Check: CheckIncomplete, Partition: st.Partition, Epoch: st.Epoch, Key: key,
				Detail: "the sink holds this effect, and no attempt of its job under its epoch completed: " + strings.Join(tries, "; ")})
		}
	}
}

// checkInjected: no forged or garbage message may be applied, whatever
// stage refused it (the runner's fence, its stamp check, or the
// destination, for a key it cannot hold), and none whose epoch and
// acquisition were never issued to its fence may even pass the fence. A
// forged copy of a live holder's exact stamp may be applied: that is the
// residual a credential that publishes effects leaves (ForgedResidual).
func (c *checker) checkInjected() {
	applied := map[string]Event{}
	for _, e := range c.in.Events {
		if e.Kind == KindDecision && e.Reason == ApplyStage && e.Outcome == "accepted" {
			applied[e.Key] = e
		}
	}
	c.out.InjectedByKind = map[string]InjectedFate{}
	positions := make([]uint64, 0, len(c.injected))
	for pos := range c.injected {
		positions = append(positions, pos)
	}
	slices.Sort(positions)
	for _, pos := range positions {
		inj := c.injected[pos]
		kind := inj.Reason
		if inj.Reason == FaultForgedMarker {
			kind += "/" + inj.Outcome
		}
		d, decided := c.decided[pos]
		admitted := decided && (d.Outcome == "accepted" || d.Outcome == "advanced")
		a, byDecision := applied[inj.Key]
		isApplied := false
		switch {
		case inj.Reason == FaultForgedMarker && inj.Outcome == ForgedFinalCopy:
			// It carries the job's own key: applied if the sink holds its
			// payload under the forged stamp's epoch.
			st, ok := c.in.Final[inj.Key]
			isApplied, byDecision = ok && c.in.Forged[inj.Key] == ForgedFinalCopy && st.Epoch == leasehold.Epoch(inj.Epoch), false
		case inj.Reason == FaultForgedMarker && (inj.Outcome == ForgedAbortCopy || inj.Outcome == ForgedAbortAhead):
			// A marker applies nothing; what it wrongly closes shows as a
			// job lost or never applied.
		case inj.Reason == FaultForgedMarker && inj.Outcome == ForgedAcqBarrier:
			isApplied = decided && d.Outcome == "advanced"
		default:
			_, inFinal := c.in.Final[inj.Key]
			isApplied = inj.Key != "" && (byDecision || inFinal)
		}
		fate := c.out.InjectedByKind[kind]
		fate.Stored++
		switch {
		case isApplied:
			fate.Applied++
			c.out.InjectedApplied++
		case decided && refusal(d.Outcome), admitted && inj.Outcome != ForgedFinalCopy:
			// Refused by the fence, or admitted by it and refused by the
			// destination (a forged final it holds a real value for is
			// set aside as a duplicate there).
			fate.Refused++
			c.out.InjectedRefused++
		default:
			fate.SetAside++
			c.out.InjectedSetAside++
		}
		c.out.InjectedByKind[kind] = fate
		excerpt := []Event{inj}
		if decided {
			excerpt = append(excerpt, d)
		}
		if byDecision {
			excerpt = append(excerpt, a)
		}
		switch {
		case inj.Reason == FaultForgedMarker && !copiesHolderStamp(inj.Outcome) && (admitted || isApplied):
			what := "passed the fence (" + d.Outcome + ")"
			if isApplied {
				what = "was applied"
			}
			c.violate(Violation{Check: CheckUnverified, Partition: leasehold.Partition(inj.Partition), Epoch: leasehold.Epoch(inj.Epoch), Key: inj.Key,
				Detail: fmt.Sprintf("the forged %s at log position %d, whose epoch and acquisition the lease bucket never issued to this partition, %s", inj.Outcome, pos, what), Excerpt: excerpt})
		case !isApplied:
		case inj.Reason == FaultForgedMarker && copiesHolderStamp(inj.Outcome):
			c.out.ForgedResidual++
		default:
			c.violate(Violation{Check: CheckUnexpected, Partition: leasehold.Partition(inj.Partition), Epoch: leasehold.Epoch(inj.Epoch), Key: inj.Key,
				Detail: fmt.Sprintf("the %s message at log position %d was applied", inj.Reason, pos), Excerpt: excerpt})
		}
	}
}

// refusal reports whether a sink's decision refused the message.
func refusal(outcome string) bool {
	switch outcome {
	case "stale", "split_brain", "unverified", "bad_stamp", "over_limit", "dead_lettered", "failed":
		return true
	}
	return false
}

// countZombies classifies the writes made under an epoch the partition
// had moved past.
func (c *checker) countZombies() {
	for i, l := range c.in.Log {
		if !c.behind[i] {
			continue
		}
		if _, ok := c.injected[l.Position]; ok || c.injKeys[l.Stamp.Key] {
			continue
		}
		c.out.ZombieAttempted++
		applied := false
		if d, ok := c.decided[l.Position]; ok {
			applied = d.Outcome == "accepted"
		} else if st, ok := c.in.Final[l.Stamp.Key]; ok && st.Epoch == l.Stamp.Epoch {
			applied = true
		}
		if applied {
			c.out.ZombieApplied++
		} else {
			c.out.ZombieRejected++
		}
	}
	// Zombie writes the log never stored: an effect event under an epoch
	// some later acquisition of its partition had superseded when it was
	// recorded, with no log entry of its own.
	acq := map[uint32][]Event{}
	for _, e := range c.in.Events {
		if e.Kind == KindAcquire {
			acq[e.Partition] = append(acq[e.Partition], e)
		}
	}
	for _, e := range c.in.Events {
		if e.Kind != KindEffect || len(c.logIdx[logKey(e.Key, leasehold.Epoch(e.Epoch))]) > 0 {
			continue
		}
		for _, a := range acq[e.Partition] {
			if a.Epoch > e.Epoch && a.Time.Before(e.Time) {
				c.out.ZombieAttempted++
				c.out.ZombieNotStored++
				break
			}
		}
	}
}

// failovers measures, for each fault that took a worker's partitions
// away, the time to the first job handled on each of them under a newer
// epoch.
func (c *checker) failovers() {
	effects := map[uint32][]Event{}
	for _, e := range c.in.Events {
		if e.Kind == KindEffect {
			effects[e.Partition] = append(effects[e.Partition], e)
		}
	}
	var ds []time.Duration
	for _, f := range c.in.Events {
		if f.Kind != KindFault || !removesHolder(f.Reason) {
			continue
		}
		for p, epoch := range c.heldAt(f.Proc, f.Time) {
			for _, e := range effects[p] {
				if e.Time.After(f.Time) && e.Epoch > epoch {
					ds = append(ds, e.Time.Sub(f.Time))
					break
				}
			}
		}
	}
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	c.out.Failovers = len(ds)
	c.out.FailoverP50Ms = ms(percentile(ds, 0.50))
	c.out.FailoverP99Ms = ms(percentile(ds, 0.99))
	c.out.FailoverMaxMs = ms(ds[len(ds)-1])
}

// heldAt returns the partitions proc held at t, with their epochs.
func (c *checker) heldAt(proc string, t time.Time) map[uint32]uint64 {
	held := map[uint32]uint64{}
	for _, e := range c.byProc[proc] {
		if e.Time.After(t) {
			break
		}
		switch e.Kind {
		case KindAcquire:
			held[e.Partition] = e.Epoch
		case KindLose, KindRelease:
			if held[e.Partition] == e.Epoch {
				delete(held, e.Partition)
			}
		}
	}
	return held
}

// percentile is the nearest-rank percentile of sorted ds.
func percentile(ds []time.Duration, q float64) time.Duration {
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/float64(time.Microsecond)) / 1000 }
