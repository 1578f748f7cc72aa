package chaos

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
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
	// HTTP is every request the HTTP receiver took, in any order (see
	// Delivery). Nil: the run had no HTTP destination, and its checks are
	// skipped.
	HTTP []Delivery
	// RelayDeadLettered are the effect keys the relays' runner moved to
	// its dead-letter stream.
	RelayDeadLettered []string
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

	// The HTTP destination's checks (f), as the KV sink's: a job's effect
	// never handled by the receiver, handled twice (after the Verifier's
	// dedupe), handled from a zombie's write behind its successor's
	// barrier or from a relay a newer relay had superseded, handled from
	// an attempt that did not complete, and a request handled that no job
	// produced.
	CheckHTTPLost       = "http-lost"
	CheckHTTPDuplicate  = "http-duplicate"
	CheckHTTPStale      = "http-stale"
	CheckHTTPIncomplete = "http-incomplete-job"
	CheckHTTPUnexpected = "http-unexpected"
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

	// HTTP is what the HTTP receiver took, judged as the KV sink is.
	HTTP HTTPFigures `json:"http"`

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
	done     map[attemptKey]bool
	flagged  map[string]bool // keys already reported as stale applications
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
//	    and every job is applied by the end of the run (see CheckLiveness);
//	(f) at the HTTP receiver, when in.HTTP is set, (a) and (b) again (see
//	    checkHTTP).
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
	c.checkHTTP() // after checkAttempts and checkLog
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
