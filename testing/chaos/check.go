package chaos

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
)

// Input is what the checker judges: the merged history of every process,
// and what the run left behind.
type Input struct {
	// Prefix is the job stream's prefix: the effect of the job at sequence
	// seq of partition p has the key leasehold.EffectKey(Prefix, p, seq, 0).
	Prefix string
	// Events is every process's history, in any order.
	Events []Event
	// Jobs is the job stream as read after the run. Nil: the enqueue
	// events alone say which jobs exist.
	Jobs []Job
	// DeadLettered are the jobs found in the dead-letter stream: handled,
	// not lost, and without an effect.
	DeadLettered []Job
	// Log is the effect log, in log order.
	Log []LogEntry
	// Final is the deduping sink's final contents: each key and the stamp
	// its value was written with.
	Final map[string]leasehold.Stamp
	// Forged names the keys of Final whose value is a payload the
	// forged-marker fault wrote, with the variant it names: such a value is
	// not the effect of the job whose key it may hold.
	Forged map[string]string
	// End is when the run ended; pending jobs stall until then. Default:
	// the last event.
	End time.Time
	// LivenessBound is the longest stall a partition may have (see
	// CheckLiveness); a run uses its lease TTL + 5s. Zero: stalls are
	// measured, not judged.
	LivenessBound time.Duration
}

// Checks a Violation can come from.
const (
	// CheckStale (a): an effect was applied with an epoch below its
	// partition's maximum at its place in the log.
	CheckStale = "stale-application"
	// CheckLost (b): a job's effect is not in the sink and can no longer
	// be: none in the effect log that a fence admits, and progress was
	// committed past it. (Not yet applied is CheckNotApplied.)
	CheckLost = "lost"
	// CheckDuplicate (b): a job's effect was applied more than once.
	CheckDuplicate = "duplicate"
	// CheckUnexpected (b): the sink holds an effect no job produced: a
	// forged or garbage message was applied.
	CheckUnexpected = "unexpected-effect"
	// CheckEpochOrder (c): a partition was acquired with an epoch not
	// above an earlier acquisition's.
	CheckEpochOrder = "epoch-order"
	// CheckHolder (d): one epoch, two holders; or an effect written under
	// an epoch its writer never acquired.
	CheckHolder = "holder"
	// CheckStoreLost: a job the producer saw acknowledged is not in the job
	// stream.
	CheckStoreLost = "enqueue-lost"
	// CheckDecision: one log position decided two ways.
	CheckDecision = "inconsistent-decision"
	// CheckIncomplete: an effect of a job was applied although no attempt
	// of the job that wrote it under its epoch completed: its attempts
	// failed (an abort marker), or never marked their effects final.
	CheckIncomplete = "incomplete-job-applied"
	// CheckUnverified: the sink admitted a message whose epoch and
	// acquisition the lease bucket never issued to its fence (a made-up
	// acquisition token, an epoch issued to another fence): it raised the
	// fence, or it was applied.
	CheckUnverified = "unverified-application"
)

// Violation is one thing the checker found wrong.
type Violation struct {
	Check     string
	Partition leasehold.Partition
	Epoch     leasehold.Epoch
	Key       string
	Detail    string
	// Excerpt holds the history events that show it, in time order.
	Excerpt []Event
}

func (v Violation) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: partition %d", v.Check, v.Partition)
	if v.Epoch != 0 {
		fmt.Fprintf(&b, " epoch %d", v.Epoch)
	}
	if v.Key != "" {
		fmt.Fprintf(&b, " key %s", v.Key)
	}
	b.WriteString(": " + v.Detail)
	for _, e := range v.Excerpt {
		b.WriteString("\n    " + formatEvent(e))
	}
	return b.String()
}

func formatEvent(e Event) string {
	s := fmt.Sprintf("%s %-12s %-8s p=%d", e.Time.Format("15:04:05.000000"), e.Proc, e.Kind, e.Partition)
	if e.Epoch != 0 {
		s += fmt.Sprintf(" epoch=%d", e.Epoch)
	}
	if e.Key != "" {
		s += " key=" + e.Key
	}
	if e.Seq != 0 {
		s += fmt.Sprintf(" seq=%d", e.Seq)
	}
	if e.Outcome != "" {
		s += " outcome=" + e.Outcome
	}
	if e.Max != 0 {
		s += fmt.Sprintf(" max=%d", e.Max)
	}
	if e.Position != 0 {
		s += fmt.Sprintf(" pos=%d", e.Position)
	}
	if e.Reason != "" {
		s += " reason=" + e.Reason
	}
	if e.Holder != "" {
		s += " holder=" + e.Holder
	}
	return s
}

// Figures are what a run measured. The JSON names are the ones `leasehold
// chaos --json` prints.
type Figures struct {
	// Faults counts the injected faults by type; forged and garbage
	// injections count one per message.
	Faults map[string]int `json:"faults"`
	// ZombieAttempted counts effects written under an epoch the partition
	// had moved past: those that reached the effect log behind a newer
	// epoch's barrier, and those the log never stored.
	ZombieAttempted int `json:"zombie_attempted"`
	// ZombieRejected counts zombie effects the sink refused.
	ZombieRejected int `json:"zombie_rejected"`
	// ZombieApplied counts zombie effects the sink applied (a violation).
	ZombieApplied int `json:"zombie_applied"`
	// ZombieNotStored counts zombie effects the effect log did not store:
	// dropped by its duplicate window (the successor had written the key
	// already) or never sent.
	ZombieNotStored int `json:"zombie_not_stored"`
	// Injected counts forged and garbage messages the effect log stored;
	// InjectedRefused those the sink refused (its fence, its stamp check,
	// or the destination), InjectedSetAside those it admitted and did not
	// apply (markers that changed nothing, effects it dropped as aborted or
	// duplicate), InjectedApplied those it applied. Only forged copies of
	// a holder's exact stamp may be applied (ForgedResidual); any other is a
	// violation.
	Injected         int `json:"injected"`
	InjectedRefused  int `json:"injected_refused"`
	InjectedSetAside int `json:"injected_set_aside"`
	InjectedApplied  int `json:"injected_applied"`
	// InjectedByKind splits the injected messages by fault, and forged
	// markers by variant ("forged_marker/abort_copy").
	InjectedByKind map[string]InjectedFate `json:"injected_by_kind,omitempty"`
	// ForgedResidual counts forged effects applied that carried a live
	// holder's exact stamp (its epoch and acquisition): what a credential
	// that may publish effects can always do, and no violation.
	// JobsDisplaced counts the jobs whose key holds such an effect in place
	// of the job's own; they are counted neither applied nor lost.
	ForgedResidual int `json:"forged_applied_at_holder_stamp"`
	JobsDisplaced  int `json:"jobs_displaced_by_forgery"`

	JobsEnqueued int `json:"jobs_enqueued"`
	JobsApplied  int `json:"jobs_applied"`
	JobsLost     int `json:"jobs_lost"`
	// JobsNotApplied counts jobs not yet applied when the run ended that
	// could still be (a liveness violation each).
	JobsNotApplied   int `json:"jobs_not_yet_applied"`
	JobsDuplicated   int `json:"jobs_duplicated"`
	JobsDeadLettered int `json:"jobs_dead_lettered"`
	// StaleApplications counts effects applied below their partition's
	// maximum (check a).
	StaleApplications int `json:"stale_applications"`

	// Fail-over: from a fault that removed a partition's holder to the
	// first job handled on that partition under a new epoch.
	Failovers     int     `json:"failovers"`
	FailoverP50Ms float64 `json:"failover_p50_ms"`
	FailoverP99Ms float64 `json:"failover_p99_ms"`
	FailoverMaxMs float64 `json:"failover_max_ms"`

	// Liveness: per partition, the longest time it had pending jobs and a
	// live holder and made no progress, leaving out what faults take away
	// (see CheckLiveness); the longest of them, where, and the bound.
	Stalls                map[string]float64 `json:"liveness_stall_ms"`
	LongestStallMs        float64            `json:"liveness_max_stall_ms"`
	LongestStallPartition string             `json:"liveness_max_stall_partition,omitempty"`
	LivenessBoundMs       float64            `json:"liveness_bound_ms"`

	// Attempts of jobs with effects, as the effect log and the workers'
	// histories record them: completed (their effects marked final) and
	// failed (closed by an abort marker).
	AttemptsCompleted int `json:"job_attempts_completed"`
	AttemptsFailed    int `json:"job_attempts_failed"`

	Acquisitions int            `json:"acquisitions"`
	Decisions    map[string]int `json:"decisions"`
	Violations   int            `json:"violations"`
}

// InjectedFate counts what became of injected messages of one kind.
type InjectedFate struct {
	Stored   int `json:"stored"`
	Refused  int `json:"refused"`
	SetAside int `json:"set_aside"`
	Applied  int `json:"applied"`
}

// Analysis is the checker's verdict.
type Analysis struct {
	Figures
	Violations []Violation `json:"-"`
}

// OK reports whether the checker found nothing wrong.
func (a *Analysis) OK() bool { return len(a.Violations) == 0 }

// checker holds the indexes one Check builds.
type checker struct {
	in  Input
	out Analysis

	byProc   map[string][]Event
	acquired map[leasehold.Epoch]Event // the acquisition of each epoch
	windows  map[string][][2]time.Time // pause and partition windows per process
	injected map[uint64]Event          // injected messages by log position
	injKeys  map[string]bool
	logIdx   map[string][]int // key + " " + epoch -> indexes into Log
	behind   []bool           // Log[i] sits behind a newer barrier of its partition
	decided  map[uint64]Event // runner decisions by log position
	flagged  map[string]bool  // keys already reported as stale applications
}

// Check judges a run's history and final state:
//
//	(a) no effect was applied with an epoch below its partition's maximum
//	    at its place in the log: the sink's decisions are walked in log
//	    order, with the maximum raised by barriers and accepted effects;
//	    independently, every value in the sink must have been written
//	    from a log entry that no newer barrier of its partition preceded;
//	(b) every job's effect is in the sink exactly once: none lost, none
//	    applied twice, and nothing in the sink that no job produced;
//	(c) each partition's epochs strictly increase across acquisitions;
//	(d) each epoch has one holder, and only it writes under that epoch;
//	(e) liveness: no partition stalls for longer than in.LivenessBound,
//	    and every job is applied by the end of the run (see CheckLiveness).
func Check(in Input) *Analysis {
	c := &checker{in: in, flagged: map[string]bool{}}
	c.out.Faults = map[string]int{}
	c.out.Decisions = map[string]int{}
	c.index()
	c.checkHolders()
	c.checkEpochOrder()
	c.checkLog()
	c.checkJobs() // after checkLog: which log entries a fence admits
	c.checkDecisions()
	c.checkFinal()
	c.checkAttempts()
	c.checkInjected()
	c.countZombies()
	c.failovers()
	c.liveness()
	sort.SliceStable(c.out.Violations, func(i, j int) bool { return c.out.Violations[i].Check < c.out.Violations[j].Check })
	c.out.Figures.Violations = len(c.out.Violations)
	return &c.out
}

func (c *checker) violate(v Violation) { c.out.Violations = append(c.out.Violations, v) }

func (c *checker) index() {
	evs := slices.Clone(c.in.Events)
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].Time.Before(evs[j].Time) })
	c.in.Events = evs
	c.byProc = map[string][]Event{}
	c.acquired = map[leasehold.Epoch]Event{}
	c.windows = map[string][][2]time.Time{}
	c.injected = map[uint64]Event{}
	c.injKeys = map[string]bool{}
	c.decided = map[uint64]Event{}
	open := map[string]time.Time{}
	for _, e := range evs {
		c.byProc[e.Proc] = append(c.byProc[e.Proc], e)
		switch e.Kind {
		case KindFault:
			if faultKinds[e.Reason] {
				c.out.Faults[e.Reason]++
			}
			switch e.Reason {
			case FaultPause, FaultPartition:
				open[e.Proc] = e.Time
			case markResume, markHeal:
				if s, ok := open[e.Proc]; ok {
					c.windows[e.Proc] = append(c.windows[e.Proc], [2]time.Time{s, e.Time})
					delete(open, e.Proc)
				}
			case FaultForged, FaultGarbage, FaultPreempt:
				c.out.Injected++
				if e.Position != 0 {
					c.injected[e.Position] = e
				}
				if e.Key != "" {
					c.injKeys[e.Key] = true
				}
			case FaultForgedMarker:
				c.out.Injected++
				if e.Position != 0 {
					c.injected[e.Position] = e
				}
				// Copies carry a real key (a job's, its abort's, a
				// barrier's): only the keys the forger made up are its own.
				if e.Key != "" && (e.Outcome == ForgedAcqEffect || e.Outcome == ForgedForeignEpoch) {
					c.injKeys[e.Key] = true
				}
			}
		case KindDecision:
			if e.Reason == ApplyStage || e.Position == 0 {
				continue
			}
			c.out.Decisions[e.Outcome]++
			if prev, ok := c.decided[e.Position]; ok && (!sameOutcome(prev.Outcome, e.Outcome) || prev.Key != e.Key || prev.Epoch != e.Epoch) {
				c.violate(Violation{Check: CheckDecision, Partition: leasehold.Partition(e.Partition), Epoch: leasehold.Epoch(e.Epoch), Key: e.Key,
					Detail: fmt.Sprintf("log position %d was decided %s and then %s", e.Position, prev.Outcome, e.Outcome), Excerpt: []Event{prev, e}})
				continue
			}
			c.decided[e.Position] = e
		}
	}
	// A window still open at the end lasts to the end.
	for proc, s := range open {
		c.windows[proc] = append(c.windows[proc], [2]time.Time{s, time.Now()})
	}
}

// sameOutcome reports whether two decisions of one log position agree. A
// job's effect applied and then, read again after a restart, found applied
// already (a duplicate) agree: the runner re-reads from short of a job still
// open, and takes what it applied for duplicates. So do an effect of an
// attempt dropped (aborted: a later attempt of its job superseded it) and,
// read again after the job was applied, found a duplicate: neither applies
// it.
func sameOutcome(a, b string) bool {
	if a == b {
		return true
	}
	pair := func(x, y string) bool { return a == x && b == y || a == y && b == x }
	return pair("accepted", "duplicate") || pair("aborted", "duplicate")
}

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
