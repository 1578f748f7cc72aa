package chaos

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
)

// Liveness is the checker's measure of progress: safety checks pass on a
// fleet that does nothing, so a run must also show that work moved.
//
// A partition stalls while it has pending jobs (enqueued and not yet
// applied by the sink, nor dead-lettered), a live holder, and makes no
// progress (no job of it applied or settled). The time counted excludes
// what the faults themselves take away: the time no live holder had the
// partition (a fail-over in progress: the fail-over figures measure it),
// the time its holder was paused or cut off by a fault, and the time the
// single server or the sink was down by a fault. The longest such stretch
// per partition is its stall; a stall above Input.LivenessBound (TTL + 5s
// in a run) is a CheckLiveness violation.
//
// At the end of a run a job whose effect is not in the sink is either lost
// or late. Lost: its effect can no longer be applied — no entry of it in
// the effect log that a fence would admit — and committed progress moved
// past it, so no worker will run it again. Late: it was not yet applied
// when the run ended, a CheckNotApplied violation (a liveness failure, not
// a lost job).

// Liveness checks a Violation can come from.
const (
	// CheckLiveness: a partition stalled for longer than the bound.
	CheckLiveness = "liveness"
	// CheckNotApplied: a job was not yet applied when the run ended, and
	// could still be: its effect waits in the effect log, or no worker has
	// committed past it.
	CheckNotApplied = "not-yet-applied"
)

// span is a stretch of time, from inclusive, to exclusive.
type span struct{ from, to time.Time }

func (s span) dur() time.Duration {
	if !s.to.After(s.from) {
		return 0
	}
	return s.to.Sub(s.from)
}

// union merges overlapping spans, sorted by start.
func union(ss []span) []span {
	ss = slices.Clone(ss)
	sort.Slice(ss, func(i, j int) bool { return ss[i].from.Before(ss[j].from) })
	var out []span
	for _, s := range ss {
		if s.dur() == 0 {
			continue
		}
		if n := len(out); n > 0 && !s.from.After(out[n-1].to) {
			if s.to.After(out[n-1].to) {
				out[n-1].to = s.to
			}
			continue
		}
		out = append(out, s)
	}
	return out
}

// subtract removes the cut spans from ss.
func subtract(ss, cut []span) []span {
	cut = union(cut)
	var out []span
	for _, s := range union(ss) {
		from := s.from
		for _, c := range cut {
			if !c.to.After(from) || !c.from.Before(s.to) {
				continue
			}
			if c.from.After(from) {
				out = append(out, span{from, c.from})
			}
			if c.to.After(from) {
				from = c.to
			}
		}
		if s.to.After(from) {
			out = append(out, span{from, s.to})
		}
	}
	return out
}

// overlap is how much of [from, to) the sorted, disjoint spans cover.
func overlap(ss []span, from, to time.Time) time.Duration {
	var d time.Duration
	for _, s := range ss {
		if !s.from.Before(to) {
			break
		}
		d += span{maxTime(s.from, from), minTime(s.to, to)}.dur()
	}
	return d
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// end is when the run ended: Input.End, or the last event.
func (c *checker) end() time.Time {
	if !c.in.End.IsZero() {
		return c.in.End
	}
	var t time.Time
	for _, e := range c.in.Events {
		t = maxTime(t, e.Time)
	}
	return t
}

// counting returns, per partition, the spans in which a stall counts: a
// holder held it and was neither paused nor cut off, and neither the
// single server nor the sink was down by a fault.
func (c *checker) counting() map[uint32][]span {
	end := c.end()
	type hold struct {
		proc  string
		epoch uint64
	}
	open := map[uint32]map[hold]time.Time{}
	held := map[uint32][]span{}
	closeHold := func(p uint32, h hold, t time.Time) {
		if from, ok := open[p][h]; ok {
			// The holder's own pauses and partitions do not count.
			held[p] = append(held[p], subtract([]span{{from, t}}, c.stoppedSpans(h.proc))...)
			delete(open[p], h)
		}
	}
	var down []span // the single server, or the sink, stopped by a fault
	downSince := map[string]time.Time{}
	for _, e := range c.in.Events {
		switch e.Kind {
		case KindAcquire:
			if open[e.Partition] == nil {
				open[e.Partition] = map[hold]time.Time{}
			}
			if _, ok := open[e.Partition][hold{e.Proc, e.Epoch}]; !ok {
				open[e.Partition][hold{e.Proc, e.Epoch}] = e.Time
			}
		case KindLose, KindRelease:
			closeHold(e.Partition, hold{e.Proc, e.Epoch}, e.Time)
		case KindFault:
			switch e.Reason {
			case FaultKill, FaultTerm:
				// A stopped process holds nothing live; its leases
				// linger on the server until their TTL.
				for p, hs := range open {
					for h := range hs {
						if h.proc == e.Proc {
							closeHold(p, h, e.Time)
						}
					}
				}
			case FaultNATSRestart, FaultSinkKill, FaultSinkTerm:
				downSince[e.Proc] = e.Time
			case markNodeRestart, markRestart:
				if from, ok := downSince[e.Proc]; ok {
					down = append(down, span{from, e.Time})
					delete(downSince, e.Proc)
				}
			}
		}
	}
	for p, hs := range open {
		for h := range hs {
			closeHold(p, h, end)
		}
	}
	for _, from := range downSince {
		down = append(down, span{from, end})
	}
	out := map[uint32][]span{}
	for p, ss := range held {
		out[p] = subtract(ss, down)
	}
	return out
}

// stoppedSpans are the pause and partition windows of proc.
func (c *checker) stoppedSpans(proc string) []span {
	var out []span
	for _, w := range c.windows[proc] {
		out = append(out, span{w[0], w[1]})
	}
	return out
}

// stall is the longest stall of one partition.
type stall struct {
	d        time.Duration
	from, to time.Time
}

// liveness measures each partition's longest stall and reports those above
// the bound. A job's pending time runs from its enqueue to its first
// application by the sink, or, for a dead-lettered job, to the first
// commit past it.
func (c *checker) liveness() {
	end := c.end()
	applied := map[string]time.Time{}
	for _, e := range c.in.Events {
		if e.Kind == KindDecision && e.Reason == ApplyStage && (e.Outcome == "accepted" || e.Outcome == "duplicate") {
			if t, ok := applied[e.Key]; !ok || e.Time.Before(t) {
				applied[e.Key] = e.Time
			}
		}
	}
	dead := map[string]bool{}
	for _, j := range c.in.DeadLettered {
		dead[leasehold.EffectKey(c.in.Prefix, j.Partition, j.Seq, 0)] = true
	}
	type point struct {
		t     time.Time
		delta int // +1 a job becomes pending, -1 one is done (progress)
	}
	points := map[uint32][]point{}
	for _, e := range c.in.Events {
		if e.Kind != KindEnqueue {
			continue
		}
		k := leasehold.EffectKey(c.in.Prefix, leasehold.Partition(e.Partition), e.Seq, 0)
		done, ok := applied[k]
		if !ok && dead[k] {
			done, ok = c.committedPast(e.Partition, e.Seq)
		}
		if !ok {
			done = end
		}
		if done.Before(e.Time) {
			continue // applied before the producer got to record it
		}
		points[e.Partition] = append(points[e.Partition], point{e.Time, +1})
		if ok {
			points[e.Partition] = append(points[e.Partition], point{done, -1})
		}
	}
	counting := c.counting()
	c.out.Stalls = map[string]float64{}
	var worst stall
	var worstP uint32
	for p, ps := range points {
		sort.SliceStable(ps, func(i, j int) bool { return ps[i].t.Before(ps[j].t) })
		var best, cur stall
		pending := 0
		var last time.Time
		for _, pt := range ps {
			if pending > 0 {
				cur.d += overlap(counting[p], last, pt.t)
				cur.to = pt.t
				if cur.d > best.d {
					best = cur
				}
			}
			pending += pt.delta
			last = pt.t
			if pt.delta < 0 || pending == 1 {
				cur = stall{from: pt.t} // progress, or the first job pending
			}
		}
		if pending > 0 {
			cur.d += overlap(counting[p], last, end)
			cur.to = end
			if cur.d > best.d {
				best = cur
			}
		}
		c.out.Stalls[leasehold.Partition(p).String()] = ms(best.d)
		if best.d > worst.d {
			worst, worstP = best, p
		}
		if c.in.LivenessBound > 0 && best.d > c.in.LivenessBound {
			c.violate(Violation{Check: CheckLiveness, Partition: leasehold.Partition(p),
				Detail: fmt.Sprintf("it had pending jobs and a live holder and made no progress for %v between %s and %s, above the bound %v (the lease TTL + 5s)",
					best.d.Round(time.Millisecond), best.from.Format("15:04:05.000"), best.to.Format("15:04:05.000"), c.in.LivenessBound),
				Excerpt: c.stallStory(p, best)})
		}
	}
	c.out.LongestStallMs = ms(worst.d)
	if worst.d > 0 {
		c.out.LongestStallPartition = leasehold.Partition(worstP).String()
	}
	c.out.LivenessBoundMs = ms(c.in.LivenessBound)
}

// committedPast returns when progress of partition p was first committed
// at or past seq.
func (c *checker) committedPast(p uint32, seq uint64) (time.Time, bool) {
	for _, e := range c.in.Events {
		if e.Kind == KindCommit && e.Partition == p && e.Seq >= seq {
			return e.Time, true
		}
	}
	return time.Time{}, false
}

// stallStory is what the history says about partition p during a stall:
// its leases and commits, and the faults.
func (c *checker) stallStory(p uint32, s stall) []Event {
	var out []Event
	for _, e := range c.in.Events {
		if e.Time.Before(s.from.Add(-time.Second)) || e.Time.After(s.to) {
			continue
		}
		switch {
		case e.Partition == p && (e.Kind == KindAcquire || e.Kind == KindLose || e.Kind == KindRelease || e.Kind == KindCommit):
		case e.Kind == KindFault && (faultKinds[e.Reason] || e.Reason == markRestart || e.Reason == markNodeRestart || e.Reason == markResume):
		default:
			continue
		}
		out = append(out, e)
		if len(out) == 30 {
			break
		}
	}
	return out
}

// unapplied judges a job whose effect is not in the sink: lost, or not yet
// applied when the run ended. An entry of its effect in the log can still
// be applied unless it sits behind a newer barrier, was injected, or the
// sink has decided it and dropped it (refused, aborted, or taken for a
// duplicate): a sink decides each position once.
func (c *checker) unapplied(k string, j Job, enq Event) {
	admissible := false
	dropped := 0
	for i, l := range c.in.Log {
		if l.Stamp.Key != k || l.BadStamp || l.Barrier || c.behind[i] {
			continue
		}
		if _, forged := c.injected[l.Position]; forged {
			continue
		}
		if d, ok := c.decided[l.Position]; ok && (refusal(d.Outcome) || d.Outcome == "aborted" || d.Outcome == "duplicate") {
			dropped++
			continue
		}
		admissible = true
	}
	_, past := c.committedPast(uint32(j.Partition), j.Seq)
	if !admissible && past {
		why := "none in the effect log that a fence admits"
		if dropped > 0 {
			why = fmt.Sprintf("the sink dropped every entry of it in the effect log (%d)", dropped)
		}
		c.out.JobsLost++
		c.violate(Violation{Check: CheckLost, Partition: j.Partition, Key: k,
			Detail:  fmt.Sprintf("job %s (sequence %d) has no effect in the sink, %s, and progress was committed past it", j.ID, j.Seq, why),
			Excerpt: c.storyOf(k, j.Partition, enq)})
		return
	}
	why := "no worker committed past it, so the next holder runs it"
	if admissible {
		why = "its effect waits in the effect log for the sink"
	}
	c.out.JobsNotApplied++
	c.violate(Violation{Check: CheckNotApplied, Partition: j.Partition, Key: k,
		Detail:  fmt.Sprintf("job %s (sequence %d) was not yet applied when the run ended (a liveness violation): %s", j.ID, j.Seq, why),
		Excerpt: c.storyOf(k, j.Partition, enq)})
}

// formatStalls lists the partitions' stalls, longest first.
func formatStalls(stalls map[string]float64) string {
	type ps struct {
		p  string
		ms float64
	}
	var l []ps
	for p, v := range stalls {
		l = append(l, ps{p, v})
	}
	sort.Slice(l, func(i, j int) bool { return l[i].ms > l[j].ms || l[i].ms == l[j].ms && l[i].p < l[j].p })
	var out []string
	for _, x := range l {
		out = append(out, fmt.Sprintf("p%s %s", x.p, msString(x.ms)))
	}
	return strings.Join(out, ", ")
}
