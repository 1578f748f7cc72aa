package chaos

import (
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/leasehold/leasehold"
)

// checkHolders is check (d): one holder per epoch (epochs are revisions of
// one bucket, so they are unique across partitions too), and every effect
// is written by the holder of its epoch.
func (c *checker) checkHolders() {
	for _, e := range c.in.Events {
		if e.Kind != KindAcquire {
			continue
		}
		c.out.Acquisitions++
		ep := leasehold.Epoch(e.Epoch)
		prev, ok := c.acquired[ep]
		if !ok {
			c.acquired[ep] = e
			continue
		}
		if prev.Proc != e.Proc || prev.Partition != e.Partition {
			c.violate(Violation{Check: CheckHolder, Partition: leasehold.Partition(e.Partition), Epoch: ep,
				Detail:  fmt.Sprintf("epoch %d was acquired by %s (partition %d) and by %s (partition %d)", ep, prev.Proc, prev.Partition, e.Proc, e.Partition),
				Excerpt: []Event{prev, e}})
		}
	}
	for _, e := range c.in.Events {
		if e.Kind != KindEffect {
			continue
		}
		a, ok := c.acquired[leasehold.Epoch(e.Epoch)]
		switch {
		case !ok:
			c.violate(Violation{Check: CheckHolder, Partition: leasehold.Partition(e.Partition), Epoch: leasehold.Epoch(e.Epoch), Key: e.Key,
				Detail: e.Proc + " wrote under an epoch no worker recorded acquiring", Excerpt: []Event{e}})
		case a.Proc != e.Proc || a.Partition != e.Partition:
			c.violate(Violation{Check: CheckHolder, Partition: leasehold.Partition(e.Partition), Epoch: leasehold.Epoch(e.Epoch), Key: e.Key,
				Detail:  fmt.Sprintf("%s wrote to partition %d under the epoch %s acquired for partition %d", e.Proc, e.Partition, a.Proc, a.Partition),
				Excerpt: []Event{a, e}})
		}
	}
}

// reorderSlack is how late a process may record an acquisition it made
// without a pause explaining the delay (scheduling on a loaded machine).
const reorderSlack = 250 * time.Millisecond

// checkEpochOrder is check (c): in the order acquisitions were recorded,
// each partition's epochs rise. A process stopped between acquiring and
// recording (a pause, a partition) records late; such a pair is ordered
// by nothing the history holds and is not judged.
func (c *checker) checkEpochOrder() {
	top := map[uint32]Event{}
	for _, e := range c.in.Events {
		if e.Kind != KindAcquire {
			continue
		}
		t, ok := top[e.Partition]
		if !ok || e.Epoch > t.Epoch {
			top[e.Partition] = e
			continue
		}
		if e.Epoch == t.Epoch && e.Proc == t.Proc {
			continue // the same acquisition recorded twice
		}
		if e.Time.Sub(t.Time) < reorderSlack || c.stoppedAcross(e.Proc, t.Time, e.Time) {
			continue
		}
		c.violate(Violation{Check: CheckEpochOrder, Partition: leasehold.Partition(e.Partition), Epoch: leasehold.Epoch(e.Epoch),
			Detail:  fmt.Sprintf("%s acquired epoch %d after %s had acquired epoch %d", e.Proc, e.Epoch, t.Proc, t.Epoch),
			Excerpt: []Event{t, e}})
	}
}

// stoppedAcross reports whether proc was stopped at from and running again
// by to.
func (c *checker) stoppedAcross(proc string, from, to time.Time) bool {
	for _, w := range c.windows[proc] {
		if !w[0].After(from) && !w[1].Before(from) && !w[1].After(to.Add(reorderSlack)) {
			return true
		}
	}
	return false
}

// checkJobs is check (b): every job's effect in the sink, once.
func (c *checker) checkJobs() {
	jobs := map[string]Job{}
	inStream := map[string]bool{}
	for _, j := range c.in.Jobs {
		k := leasehold.EffectKey(c.in.Prefix, j.Partition, j.Seq, 0)
		jobs[k], inStream[k] = j, true
	}
	enq := map[string]Event{}
	for _, e := range c.in.Events {
		if e.Kind != KindEnqueue {
			continue
		}
		k := leasehold.EffectKey(c.in.Prefix, leasehold.Partition(e.Partition), e.Seq, 0)
		enq[k] = e
		if c.in.Jobs != nil && !inStream[k] {
			c.violate(Violation{Check: CheckStoreLost, Partition: leasehold.Partition(e.Partition), Key: k,
				Detail: fmt.Sprintf("job %s was acknowledged at sequence %d but the job stream does not hold it", e.JobID, e.Seq), Excerpt: []Event{e}})
		}
		if _, ok := jobs[k]; !ok {
			jobs[k] = Job{Partition: leasehold.Partition(e.Partition), Seq: e.Seq, ID: e.JobID}
		}
	}
	dead := map[string]bool{}
	for _, j := range c.in.DeadLettered {
		dead[leasehold.EffectKey(c.in.Prefix, j.Partition, j.Seq, 0)] = true
	}
	c.out.JobsEnqueued = len(jobs)
	applied := map[string][]Event{}
	for _, e := range c.in.Events {
		if e.Kind == KindDecision && e.Reason == ApplyStage && e.Outcome == "accepted" {
			applied[e.Key] = append(applied[e.Key], e)
		}
	}
	keys := make([]string, 0, len(jobs))
	for k := range jobs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		j := jobs[k]
		n := len(applied[k])
		if c.in.Forged[k] != "" && n > 0 {
			n-- // one application is the forged value the sink holds
		}
		if n > 1 {
			c.out.JobsDuplicated++
			c.violate(Violation{Check: CheckDuplicate, Partition: j.Partition, Key: k,
				Detail: fmt.Sprintf("applied %d times", n), Excerpt: applied[k]})
		}
		if _, ok := c.in.Final[k]; ok {
			if c.in.Forged[k] != "" {
				// A forged copy of the holder's exact stamp took the key
				// (judged by checkInjected): the job's own effect is not
				// there, and cannot be.
				c.out.JobsDisplaced++
				continue
			}
			c.out.JobsApplied++
			continue
		}
		if dead[k] {
			c.out.JobsDeadLettered++
			continue
		}
		c.unapplied(k, j, enq[k])
	}
	for k, st := range c.in.Final {
		if _, ok := jobs[k]; ok || c.injKeys[k] {
			continue // injected keys are judged by checkInjected
		}
		c.violate(Violation{Check: CheckUnexpected, Partition: st.Partition, Epoch: st.Epoch, Key: k, Detail: "the sink holds this effect, and no job produced it"})
	}
}

// storyOf gathers what the history says about one key and its partition's
// leases around it: the excerpt of a lost job.
func (c *checker) storyOf(key string, p leasehold.Partition, enq Event) []Event {
	var out []Event
	if !enq.Time.IsZero() {
		out = append(out, enq)
	}
	pos := map[uint64]bool{}
	for _, l := range c.in.Log {
		if l.Stamp.Key == key {
			pos[l.Position] = true
		}
	}
	for _, e := range c.in.Events {
		switch {
		case e.Key == key:
			out = append(out, e)
		case e.Kind == KindDecision && pos[e.Position]:
			out = append(out, e)
		case e.Kind == KindFault && e.Reason == FaultForgedMarker && leasehold.Partition(e.Partition) == p &&
			(e.Seq == enq.Seq && enq.Seq != 0 || !enq.Time.IsZero() && e.Time.After(enq.Time.Add(-30*time.Second)) && e.Time.Before(enq.Time.Add(30*time.Second))):
			out = append(out, e)
		case leasehold.Partition(e.Partition) == p && (e.Kind == KindAcquire || e.Kind == KindLose || e.Kind == KindRelease) &&
			!enq.Time.IsZero() && e.Time.After(enq.Time.Add(-30*time.Second)):
			out = append(out, e)
		case e.Kind == KindFault && !enq.Time.IsZero() && e.Time.After(enq.Time.Add(-30*time.Second)) && e.Time.Before(enq.Time.Add(60*time.Second)) && faultKinds[e.Reason] && removesHolder(e.Reason):
			out = append(out, e)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Time.Before(out[j].Time) })
	return out
}

func logKey(k string, e leasehold.Epoch) string { return k + " " + e.String() }

// checkLog walks the effect log: which entries sit behind a newer barrier
// of their partition (the writes a fence must refuse), and which epochs
// wrote without their holder.
func (c *checker) checkLog() {
	c.logIdx = map[string][]int{}
	c.behind = make([]bool, len(c.in.Log))
	barrier := map[leasehold.Partition]leasehold.Epoch{}
	for i, l := range c.in.Log {
		if l.BadStamp {
			continue
		}
		if l.Barrier {
			// A forged barrier orders nothing: the writes a fence must
			// refuse are those behind a holder's own.
			if _, forged := c.injected[l.Position]; !forged {
				barrier[l.Stamp.Partition] = max(barrier[l.Stamp.Partition], l.Stamp.Epoch)
			}
			continue
		}
		c.behind[i] = l.Stamp.Epoch < barrier[l.Stamp.Partition]
		k := logKey(l.Stamp.Key, l.Stamp.Epoch)
		c.logIdx[k] = append(c.logIdx[k], i)
	}
}

// checkDecisions is check (a) over the sink's own decisions, in log order.
func (c *checker) checkDecisions() {
	positions := make([]uint64, 0, len(c.decided))
	for pos := range c.decided {
		positions = append(positions, pos)
	}
	slices.Sort(positions)
	logAt := map[uint64]int{}
	for i, l := range c.in.Log {
		logAt[l.Position] = i
	}
	maxOf := map[uint32]uint64{}
	last := map[uint32]Event{}
	for _, pos := range positions {
		d := c.decided[pos]
		if _, forged := c.injected[pos]; forged {
			continue // judged by checkInjected
		}
		switch d.Outcome {
		case "advanced":
			if d.Epoch > maxOf[d.Partition] {
				maxOf[d.Partition], last[d.Partition] = d.Epoch, d
			}
		case "accepted", "duplicate", "aborted":
			// A duplicate was admitted but not applied again, and so was an
			// effect of a job attempt that did not complete: each moves the
			// maximum as an accepted effect does, and is no application.
			if d.Outcome != "accepted" {
				if d.Epoch > maxOf[d.Partition] {
					maxOf[d.Partition], last[d.Partition] = d.Epoch, d
				}
				continue
			}
			i, inLog := logAt[pos]
			switch {
			case d.Epoch < maxOf[d.Partition]:
				c.staleApplied(d.Key, Violation{Check: CheckStale, Partition: leasehold.Partition(d.Partition), Epoch: leasehold.Epoch(d.Epoch), Key: d.Key,
					Detail:  fmt.Sprintf("accepted at log position %d with epoch %d below the partition's maximum %d", pos, d.Epoch, maxOf[d.Partition]),
					Excerpt: []Event{last[d.Partition], d}})
			case inLog && c.behind[i]:
				c.staleApplied(d.Key, Violation{Check: CheckStale, Partition: leasehold.Partition(d.Partition), Epoch: leasehold.Epoch(d.Epoch), Key: d.Key,
					Detail: fmt.Sprintf("accepted at log position %d, behind a barrier of a newer epoch in the effect log", pos), Excerpt: []Event{d}})
			}
			if d.Epoch > maxOf[d.Partition] {
				maxOf[d.Partition], last[d.Partition] = d.Epoch, d
			}
		}
	}
}

// realEntries are the indexes into Log of key's entries under epoch e that
// were not injected.
func (c *checker) realEntries(key string, e leasehold.Epoch) []int {
	var out []int
	for _, i := range c.logIdx[logKey(key, e)] {
		if _, forged := c.injected[c.in.Log[i].Position]; !forged {
			out = append(out, i)
		}
	}
	return out
}

func (c *checker) staleApplied(key string, v Violation) {
	if c.flagged[key] {
		return
	}
	c.flagged[key] = true
	c.out.StaleApplications++
	c.violate(v)
}

// checkFinal is check (a) over the sink's final contents, independent of
// its decisions: each value must come from a log entry that no newer
// barrier preceded.
func (c *checker) checkFinal() {
	for k, st := range c.in.Final {
		if c.injKeys[k] || c.in.Forged[k] != "" {
			continue // judged by checkInjected
		}
		idx := c.realEntries(k, st.Epoch)
		if len(idx) == 0 {
			c.violate(Violation{Check: CheckUnexpected, Partition: st.Partition, Epoch: st.Epoch, Key: k,
				Detail: "the sink holds a value written under an epoch that never wrote this key into the effect log"})
			continue
		}
		allBehind := true
		for _, i := range idx {
			allBehind = allBehind && c.behind[i]
		}
		if allBehind {
			l := c.in.Log[idx[0]]
			c.staleApplied(k, Violation{Check: CheckStale, Partition: st.Partition, Epoch: st.Epoch, Key: k,
				Detail: fmt.Sprintf("the sink's value was written under epoch %d, which reached the effect log (position %d) only behind a newer barrier", st.Epoch, l.Position)})
		}
	}
}
