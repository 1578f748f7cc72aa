package chaos

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// story builds a small history: partition 0, worker a at epoch 10 handles
// job 1, is paused, worker b takes over at epoch 20 (barrier at log
// position 3) and handles jobs 1 (again) and 2.
type story struct {
	t0      time.Time
	in      Input
	pos     uint64
	httpSeq uint64 // the HTTP receiver's sequence (see request)
}

func newStory() *story {
	s := &story{t0: time.Unix(1_800_000_000, 0), in: Input{Prefix: "chaos", Final: map[string]leasehold.Stamp{}}}
	s.in.Jobs = []Job{{Partition: 0, Seq: 1, ID: "job-1"}, {Partition: 0, Seq: 2, ID: "job-2"}}
	s.ev(0, Event{Proc: "producer", Kind: KindEnqueue, Seq: 1, JobID: "job-1"})
	s.ev(1, Event{Proc: "producer", Kind: KindEnqueue, Seq: 2, JobID: "job-2"})
	s.ev(2, Event{Proc: "a", Kind: KindAcquire, Epoch: 10})
	s.barrier(3, "a", 10)
	s.ev(4, Event{Proc: "a", Kind: KindFault, Reason: FaultPause})
	s.ev(8, Event{Proc: "b", Kind: KindAcquire, Epoch: 20})
	s.barrier(9, "b", 20)
	s.effect(10, "b", 20, 1)
	s.effect(11, "b", 20, 2)
	s.ev(12, Event{Proc: "a", Kind: KindFault, Reason: markResume})
	return s
}

func (s *story) at(sec int) time.Time { return s.t0.Add(time.Duration(sec) * time.Second) }

func (s *story) ev(sec int, e Event) {
	e.Time = s.at(sec)
	s.in.Events = append(s.in.Events, e)
}

func (s *story) key(seq uint64) string { return leasehold.EffectKey("chaos", 0, seq, 0) }

func (s *story) barrier(sec int, proc string, epoch leasehold.Epoch) {
	s.pos++
	st := leasehold.Stamp{Scope: "chaos", Acquisition: "a", Partition: 0, Epoch: epoch, Key: leasehold.BarrierKey("chaos", 0, epoch), Worker: proc}
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: st, Barrier: true})
	s.ev(sec, Event{Proc: "sink", Kind: KindDecision, Epoch: uint64(epoch), Key: st.Key, Outcome: "advanced", Max: uint64(epoch), Position: s.pos})
}

// effect writes job seq's effect into the log and lets the sink decide it
// the way a fence would.
func (s *story) effect(sec int, proc string, epoch leasehold.Epoch, seq uint64) {
	s.pos++
	k := s.key(seq)
	st := leasehold.Stamp{Scope: "chaos", Acquisition: "a", Partition: 0, Epoch: epoch, Key: k, Worker: proc}
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: st})
	s.ev(sec, Event{Proc: proc, Kind: KindEffect, Epoch: uint64(epoch), Key: k, Seq: seq})
	top := uint64(0)
	for _, e := range s.in.Events {
		if e.Kind == KindDecision && e.Reason == "" && (e.Outcome == "advanced" || e.Outcome == "accepted") {
			top = e.Max
		}
	}
	out := "accepted"
	if uint64(epoch) < top {
		out = "stale"
	}
	s.ev(sec, Event{Proc: "sink", Kind: KindDecision, Epoch: uint64(epoch), Key: k, Outcome: out, Max: max(top, uint64(epoch)), Position: s.pos})
	if out == "accepted" {
		if _, ok := s.in.Final[k]; !ok {
			s.in.Final[k] = st
			s.ev(sec, Event{Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: uint64(epoch), Key: k, Outcome: "accepted"})
		}
	}
}

func checks(a *Analysis) string {
	var out []string
	for _, v := range a.Violations {
		out = append(out, v.Check)
	}
	return strings.Join(out, ",")
}

func TestCheckPassesAFencedRun(t *testing.T) {
	s := newStory()
	s.effect(13, "a", 10, 1) // the zombie's late write, refused
	a := Check(s.in)
	if !a.OK() {
		for _, v := range a.Violations {
			t.Error(v)
		}
	}
	if a.ZombieAttempted != 1 || a.ZombieRejected != 1 || a.ZombieApplied != 0 || a.JobsEnqueued != 2 || a.JobsApplied != 2 {
		t.Fatalf("figures %+v", a.Figures)
	}
	if a.Faults[FaultPause] != 1 || a.Failovers != 1 {
		t.Fatalf("faults %v, failovers %d", a.Faults, a.Failovers)
	}
}

// The zombie's write lands behind the barrier and before its successor's:
// an unfenced sink applies it. Check (a) finds it from the decisions, and
// again from the final contents when the decisions are missing.
func TestCheckFindsStaleApplication(t *testing.T) {
	s := newStory()
	s.in.Events = s.in.Events[:len(s.in.Events)-1]
	// Rewrite the log: the zombie's write comes right after b's barrier.
	s.in.Log, s.pos, s.in.Final = nil, 0, map[string]leasehold.Stamp{}
	var kept []Event
	for _, e := range s.in.Events {
		if e.Kind != KindDecision && e.Kind != KindEffect {
			kept = append(kept, e)
		}
	}
	s.in.Events = kept
	s.barrier(3, "a", 10)
	s.barrier(9, "b", 20)
	s.pos++
	zombie := leasehold.Stamp{Scope: "chaos", Acquisition: "a", Partition: 0, Epoch: 10, Key: s.key(1), Worker: "a"}
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: zombie})
	s.ev(9, Event{Proc: "a", Kind: KindEffect, Epoch: 10, Key: zombie.Key, Seq: 1})
	s.ev(9, Event{Proc: "sink", Kind: KindDecision, Epoch: 10, Key: zombie.Key, Outcome: "accepted", Max: 20, Position: s.pos})
	s.ev(9, Event{Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: 10, Key: zombie.Key, Outcome: "accepted"})
	s.in.Final[zombie.Key] = zombie
	s.effect(10, "b", 20, 1)
	s.effect(11, "b", 20, 2)

	a := Check(s.in)
	if a.StaleApplications != 1 || a.ZombieApplied != 1 || checks(a) != CheckStale {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
	if !strings.Contains(a.Violations[0].String(), "below the partition's maximum") {
		t.Fatalf("violation: %s", a.Violations[0])
	}

	// Without the sink's decisions, the final contents tell the same.
	var noDecisions []Event
	for _, e := range s.in.Events {
		if e.Kind != KindDecision {
			noDecisions = append(noDecisions, e)
		}
	}
	s.in.Events = noDecisions
	a = Check(s.in)
	if a.StaleApplications != 1 || checks(a) != CheckStale {
		t.Fatalf("from the final state: violations %q", checks(a))
	}
}

func TestCheckFindsLostAndDuplicated(t *testing.T) {
	s := newStory()
	// Job 2's effect is neither in the sink nor in the effect log, and b
	// committed past it: nothing can apply it any more.
	delete(s.in.Final, s.key(2))
	s.in.Log = slices.DeleteFunc(s.in.Log, func(l LogEntry) bool { return l.Stamp.Key == s.key(2) })
	s.ev(12, Event{Proc: "b", Kind: KindCommit, Epoch: 20, Seq: 2})
	s.ev(14, Event{Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: 20, Key: s.key(1), Outcome: "accepted"})
	a := Check(s.in)
	if a.JobsLost != 1 || a.JobsDuplicated != 1 || checks(a) != CheckDuplicate+","+CheckLost {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
	var lost Violation
	for _, v := range a.Violations {
		if v.Check == CheckLost {
			lost = v
		}
	}
	if lost.Key != s.key(2) || len(lost.Excerpt) == 0 {
		t.Fatalf("lost: %s", lost)
	}

	// A job the producer saw acknowledged but the stream lacks.
	s = newStory()
	s.in.Jobs = s.in.Jobs[:1]
	if a := Check(s.in); checks(a) != CheckStoreLost {
		t.Fatalf("violations %q", checks(a))
	}
	// A dead-lettered job is accounted for, not lost.
	s = newStory()
	delete(s.in.Final, s.key(2))
	s.in.DeadLettered = []Job{{Partition: 0, Seq: 2}}
	if a := Check(s.in); !a.OK() || a.JobsDeadLettered != 1 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
}

func TestCheckFindsEpochAndHolderViolations(t *testing.T) {
	// Epoch 15 acquired after 20: the bucket went backwards.
	s := newStory()
	s.ev(20, Event{Proc: "c", Kind: KindAcquire, Epoch: 15})
	if a := Check(s.in); checks(a) != CheckEpochOrder {
		t.Fatalf("violations %q", checks(a))
	}
	// ... unless c was paused across b's acquisition: then its record is
	// late and the order unknown.
	s.ev(7, Event{Proc: "c", Kind: KindFault, Reason: FaultPause})
	s.ev(19, Event{Proc: "c", Kind: KindFault, Reason: markResume})
	if a := Check(s.in); !a.OK() {
		t.Fatalf("violations %q", checks(a))
	}

	// Two holders of epoch 20.
	s = newStory()
	s.ev(20, Event{Proc: "c", Kind: KindAcquire, Epoch: 20})
	if a := Check(s.in); checks(a) != CheckEpochOrder+","+CheckHolder {
		t.Fatalf("violations %q", checks(a))
	}
	// A write under an epoch its writer never acquired.
	s = newStory()
	s.ev(20, Event{Proc: "c", Kind: KindEffect, Epoch: 20, Key: s.key(2), Seq: 2})
	if a := Check(s.in); checks(a) != CheckHolder {
		t.Fatalf("violations %q", checks(a))
	}
}

func TestCheckFindsAppliedForgery(t *testing.T) {
	s := newStory()
	s.pos++
	forged := leasehold.Stamp{Scope: "chaos", Acquisition: "a", Partition: 0, Epoch: 1 << 50, Key: "chaos.forged.1", Worker: "forger"}
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: forged})
	s.ev(13, Event{Proc: effectProc, Kind: KindFault, Reason: FaultForged, Epoch: uint64(forged.Epoch), Key: forged.Key, Position: s.pos})
	s.ev(13, Event{Proc: "sink", Kind: KindDecision, Epoch: uint64(forged.Epoch), Key: forged.Key, Outcome: "unverified", Position: s.pos})
	a := Check(s.in)
	if !a.OK() || a.Injected != 1 || a.InjectedRefused != 1 {
		t.Fatalf("a refused forgery: violations %q, figures %+v", checks(a), a.Figures)
	}
	s.in.Events[len(s.in.Events)-1].Outcome = "accepted"
	s.in.Final[forged.Key] = forged
	if a := Check(s.in); !strings.Contains(checks(a), CheckUnexpected) {
		t.Fatalf("an applied forgery: violations %q", checks(a))
	}
}

func TestCheckFailover(t *testing.T) {
	s := newStory()
	// a held partition 0 at epoch 10 when paused at 4s; b's first job
	// under epoch 20 came at 10s.
	a := Check(s.in)
	if a.Failovers != 1 || a.FailoverP50Ms != 6000 || a.FailoverP99Ms != 6000 {
		t.Fatalf("failovers %d p50 %v p99 %v", a.Failovers, a.FailoverP50Ms, a.FailoverP99Ms)
	}
	ds := []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	if percentile(ds, 0.5) != 5 || percentile(ds, 0.99) != 10 || percentile(ds[:1], 0.99) != 1 {
		t.Fatal("percentile")
	}
}

// A value in the sink from an attempt that never completed (its effects
// not marked final, an abort marker after them) is found; one from an
// attempt whose final is in the log is not. A worker's record that the
// attempt completed does not excuse a final missing from the log, and its
// record of a failure counts the attempt failed.
func TestCheckFindsIncompleteJobApplied(t *testing.T) {
	s := newStory()
	for i := range s.in.Log {
		l := &s.in.Log[i]
		switch l.Stamp.Key {
		case s.key(1):
			l.Mark = leasehold.JobMark{Job: 1, Attempt: 1, Effects: 1}
		case s.key(2):
			l.Mark = leasehold.JobMark{Job: 2, Attempt: 2}
		}
	}
	s.pos++
	abort := leasehold.Stamp{Scope: "chaos", Acquisition: "a", Partition: 0, Epoch: 20, Key: "chaos.0.2.abort.2", Worker: "b"}
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: abort, Mark: leasehold.JobMark{Job: 2, Attempt: 2, Abort: true}})
	a := Check(s.in)
	if got := checks(a); got != CheckIncomplete {
		t.Fatalf("violations %q, want %s: %v", got, CheckIncomplete, a.Violations)
	}
	if v := a.Violations[0]; v.Key != s.key(2) || !strings.Contains(v.Detail, "aborted") {
		t.Errorf("violation %v, want job 2's aborted attempt", v)
	}
	if a.AttemptsCompleted != 1 || a.AttemptsFailed != 1 {
		t.Errorf("attempts: %d completed, %d failed; want 1 and 1", a.AttemptsCompleted, a.AttemptsFailed)
	}

	// The worker's record of a completed attempt is not enough.
	s.in.Log = s.in.Log[:len(s.in.Log)-1]
	s.ev(12, Event{Proc: "b", Kind: KindAttempt, Epoch: 20, Seq: 2, Attempt: 2, Outcome: "completed"})
	if got := checks(Check(s.in)); got != CheckIncomplete {
		t.Errorf("violations %q after the attempt was recorded completed without a final in the log, want %s", got, CheckIncomplete)
	}
	// Its record of a failure, without an abort marker, counts.
	s.in.Events = s.in.Events[:len(s.in.Events)-1]
	s.ev(12, Event{Proc: "b", Kind: KindAttempt, Epoch: 20, Seq: 2, Attempt: 2, Outcome: "failed"})
	if a := Check(s.in); checks(a) != CheckIncomplete || a.AttemptsFailed != 1 {
		t.Errorf("violations %q, %d failed attempts, after the attempt was recorded failed", checks(a), a.AttemptsFailed)
	}
}

// forgedMarker puts a message of the forged-marker fault into the log with
// the sink's decision on it ("" for none), as the forger and the sink record
// them.
func (s *story) forgedMarker(sec int, variant string, st leasehold.Stamp, mark leasehold.JobMark, barrier bool, outcome string) uint64 {
	s.pos++
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: st, Mark: mark, Barrier: barrier})
	s.ev(sec, Event{Proc: effectProc, Kind: KindFault, Reason: FaultForgedMarker, Outcome: variant, Epoch: uint64(st.Epoch), Key: st.Key,
		Seq: mark.Job, Attempt: mark.Attempt, Position: s.pos})
	if outcome != "" {
		s.ev(sec, Event{Proc: "sink", Kind: KindDecision, Epoch: uint64(st.Epoch), Key: st.Key, Outcome: outcome, Position: s.pos})
	}
	return s.pos
}

// Forged acquisitions: a barrier and an effect with b's epoch and a
// made-up token, and an effect with an epoch issued to another fence. Each
// is an unverified application if the sink admits it, and nothing if it
// refuses it.
func TestCheckJudgesForgedAcquisitions(t *testing.T) {
	made := leasehold.Stamp{Scope: "chaos", Partition: 0, Epoch: 20, Acquisition: "madeup", Key: leasehold.BarrierKey("chaos", 0, 20), Worker: "b"}
	effect := made
	effect.Key = "chaos.0.forged-acquisition.1"
	foreign := leasehold.Stamp{Scope: "chaos", Partition: 0, Epoch: 15, Acquisition: "other", Key: "chaos.0.forged-foreign.2", Worker: "b"}
	build := func(barrierOutcome, effectOutcome string) *story {
		s := newStory()
		s.forgedMarker(8, ForgedForeignEpoch, foreign, leasehold.JobMark{}, false, effectOutcome)
		s.forgedMarker(8, ForgedAcqBarrier, made, leasehold.JobMark{}, true, barrierOutcome)
		s.forgedMarker(8, ForgedAcqEffect, effect, leasehold.JobMark{}, false, effectOutcome)
		return s
	}
	a := Check(build("unverified", "unverified").in)
	if !a.OK() || a.Injected != 3 || a.InjectedRefused != 3 || a.InjectedApplied != 0 {
		t.Fatalf("refused forgeries: violations %v, figures %+v", a.Violations, a.Figures)
	}
	if f := a.InjectedByKind[FaultForgedMarker+"/"+ForgedAcqBarrier]; f != (InjectedFate{Stored: 1, Refused: 1}) {
		t.Fatalf("barrier fate %+v", f)
	}

	s := build("advanced", "accepted")
	s.in.Final[effect.Key] = effect
	a = Check(s.in)
	if got := checks(a); got != strings.Repeat(CheckUnverified+",", 2)+CheckUnverified {
		t.Fatalf("admitted forgeries: violations %q, want three %s: %v", got, CheckUnverified, a.Violations)
	}
	if a.InjectedApplied != 2 || a.InjectedRefused != 1 || a.ForgedResidual != 0 {
		t.Fatalf("figures %+v", a.Figures)
	}
}

// A forged barrier with the next holder's epoch reaches the log before the
// previous holder's last write, which the sink rightly applies: the forged
// barrier orders nothing, so that write is neither stale nor a zombie's.
func TestCheckForgedBarrierOrdersNothing(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	at := func(sec int) time.Time { return t0.Add(time.Duration(sec) * time.Second) }
	key := func(seq uint64) string { return leasehold.EffectKey("chaos", 0, seq, 0) }
	stamp := func(epoch leasehold.Epoch, acq, key, proc string) leasehold.Stamp {
		return leasehold.Stamp{Scope: "chaos", Partition: 0, Epoch: epoch, Acquisition: acq, Key: key, Worker: proc}
	}
	in := Input{Prefix: "chaos", Final: map[string]leasehold.Stamp{key(1): stamp(10, "a", key(1), "a"), key(2): stamp(20, "b", key(2), "b")},
		Jobs: []Job{{Partition: 0, Seq: 1, ID: "job-1"}, {Partition: 0, Seq: 2, ID: "job-2"}}}
	in.Log = []LogEntry{
		{Position: 1, Stamp: stamp(10, "a", leasehold.BarrierKey("chaos", 0, 10), "a"), Barrier: true},
		{Position: 2, Stamp: stamp(20, "madeup", leasehold.BarrierKey("chaos", 0, 20), "b"), Barrier: true},
		{Position: 3, Stamp: in.Final[key(1)]},
		{Position: 4, Stamp: stamp(20, "b", leasehold.BarrierKey("chaos", 0, 20), "b"), Barrier: true},
		{Position: 5, Stamp: in.Final[key(2)]},
	}
	in.Events = []Event{
		{Time: at(0), Proc: "producer", Kind: KindEnqueue, Seq: 1, JobID: "job-1"},
		{Time: at(0), Proc: "producer", Kind: KindEnqueue, Seq: 2, JobID: "job-2"},
		{Time: at(1), Proc: "a", Kind: KindAcquire, Epoch: 10},
		{Time: at(1), Proc: "sink", Kind: KindDecision, Epoch: 10, Outcome: "advanced", Max: 10, Position: 1},
		{Time: at(2), Proc: "a", Kind: KindEffect, Epoch: 10, Key: key(1), Seq: 1},
		{Time: at(2), Proc: "a", Kind: KindRelease, Epoch: 10},
		{Time: at(2), Proc: effectProc, Kind: KindFault, Reason: FaultForgedMarker, Outcome: ForgedAcqBarrier, Epoch: 20, Position: 2},
		{Time: at(2), Proc: "sink", Kind: KindDecision, Epoch: 20, Outcome: "unverified", Max: 10, Position: 2},
		{Time: at(2), Proc: "sink", Kind: KindDecision, Epoch: 10, Key: key(1), Outcome: "accepted", Max: 10, Position: 3},
		{Time: at(2), Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: 10, Key: key(1), Outcome: "accepted"},
		{Time: at(3), Proc: "b", Kind: KindAcquire, Epoch: 20},
		{Time: at(3), Proc: "sink", Kind: KindDecision, Epoch: 20, Outcome: "advanced", Max: 20, Position: 4},
		{Time: at(4), Proc: "b", Kind: KindEffect, Epoch: 20, Key: key(2), Seq: 2},
		{Time: at(4), Proc: "sink", Kind: KindDecision, Epoch: 20, Key: key(2), Outcome: "accepted", Max: 20, Position: 5},
		{Time: at(4), Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: 20, Key: key(2), Outcome: "accepted"},
	}
	a := Check(in)
	if !a.OK() || a.ZombieAttempted != 0 || a.JobsApplied != 2 || a.InjectedRefused != 1 {
		t.Fatalf("violations %v, figures %+v", a.Violations, a.Figures)
	}
}

// A forged abort marker that closed a job's only attempt before it ran:
// the sink dropped the job's effect as aborted, and the worker committed
// past it. The job is lost, and the checker says the sink dropped it.
func TestCheckFindsJobLostToForgedAbort(t *testing.T) {
	s := newStory()
	st := leasehold.Stamp{Scope: "chaos", Partition: 0, Epoch: 20, Acquisition: "a", Key: "chaos.0.2.abort.9007199254740992", Worker: "b"}
	s.forgedMarker(9, ForgedAbortAhead, st, leasehold.JobMark{Job: 2, Attempt: leasehold.MaxAttempt, Abort: true}, false, "")
	delete(s.in.Final, s.key(2))
	for i := range s.in.Events {
		if e := &s.in.Events[i]; e.Kind == KindDecision && e.Key == s.key(2) {
			e.Outcome = "aborted"
		}
	}
	s.in.Events = slices.DeleteFunc(s.in.Events, func(e Event) bool {
		return e.Kind == KindDecision && e.Reason == ApplyStage && e.Key == s.key(2)
	})
	s.ev(12, Event{Proc: "b", Kind: KindCommit, Epoch: 20, Seq: 2})
	a := Check(s.in)
	if checks(a) != CheckLost || a.JobsLost != 1 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
	v := a.Violations[0]
	if v.Key != s.key(2) || !strings.Contains(v.Detail, "dropped every entry") || !slices.ContainsFunc(v.Excerpt, func(e Event) bool { return e.Reason == FaultForgedMarker }) {
		t.Fatalf("violation %s", v)
	}
	if a.InjectedSetAside != 1 {
		t.Fatalf("figures %+v", a.Figures)
	}
	// Not yet decided, the effect may still apply: late, not lost.
	for i := range s.in.Events {
		if e := &s.in.Events[i]; e.Kind == KindDecision && e.Key == s.key(2) {
			e.Position = 0
		}
	}
	if a := Check(s.in); checks(a) != CheckNotApplied {
		t.Fatalf("undecided: violations %q", checks(a))
	}
}

// A forged final of a higher attempt, with the holder's exact stamp and its
// own payload, was applied under job 2's key: the accepted residual,
// counted apart. Job 2 is neither applied, lost nor duplicated, its forged
// final completes no attempt, and a forged abort of a completed attempt
// fails none.
func TestCheckCountsForgedFinalApart(t *testing.T) {
	s := newStory()
	st := s.in.Final[s.key(2)]
	s.forgedMarker(11, ForgedFinalCopy, st, leasehold.JobMark{Job: 2, Attempt: 2, Effects: 1}, false, "accepted")
	abort := st
	abort.Key = "chaos.0.2.abort.1"
	s.forgedMarker(11, ForgedAbortCopy, abort, leasehold.JobMark{Job: 2, Attempt: 1, Abort: true}, false, "")
	s.ev(11, Event{Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: 20, Key: s.key(2), Outcome: "accepted"})
	s.in.Forged = map[string]string{s.key(2): ForgedFinalCopy}
	a := Check(s.in)
	if !a.OK() {
		t.Fatalf("violations %v", a.Violations)
	}
	if a.ForgedResidual != 1 || a.JobsDisplaced != 1 || a.JobsApplied != 1 || a.JobsDuplicated != 0 || a.InjectedApplied != 1 || a.InjectedSetAside != 1 {
		t.Fatalf("figures %+v", a.Figures)
	}
	if a.AttemptsCompleted != 0 || a.AttemptsFailed != 0 {
		t.Fatalf("forged markers counted as attempts: %d completed, %d failed", a.AttemptsCompleted, a.AttemptsFailed)
	}
}

func TestForgedVariant(t *testing.T) {
	f := &forger{rnd: rand.New(rand.NewPCG(1, 2)), h: &harness{}}
	for _, v := range []string{ForgedFinalCopy, ForgedAcqEffect} {
		if got := forgedVariant(f.payload(v)); got != v {
			t.Errorf("forgedVariant(payload(%q)) = %q", v, got)
		}
	}
	for _, data := range []string{"", `{"job":"job-1"}`, "leasehold-chaos-forge final_copy"} {
		if got := forgedVariant([]byte(data)); got != "" {
			t.Errorf("forgedVariant(%q) = %q, want none", data, got)
		}
	}
}

// A forged final completes the failed attempt of job 2 whose first effect
// is in the log, and the runner applies that attempt's effect; the job's
// next attempt, which completed, is found a duplicate. The key holds an
// effect of an attempt that did not complete, although another attempt of
// the job completed: the runner's decisions say which entry it applied.
func TestCheckJudgesTheAttemptApplied(t *testing.T) {
	s := newStory()
	st := s.in.Final[s.key(2)]
	// b's effect of job 2 (log position 4) becomes attempt 2's final.
	for i := range s.in.Log {
		if s.in.Log[i].Stamp.Key == s.key(2) {
			s.in.Log[i].Mark = leasehold.JobMark{Job: 2, Attempt: 2, Effects: 1}
			for j := range s.in.Events {
				if e := &s.in.Events[j]; e.Kind == KindDecision && e.Reason == "" && e.Position == s.in.Log[i].Position {
					e.Outcome = "duplicate"
				}
			}
		}
	}
	// Attempt 1's effect, before it, was applied once a forged final made
	// its attempt look complete.
	s.pos++
	s.in.Log = append(s.in.Log, LogEntry{Position: s.pos, Stamp: st, Mark: leasehold.JobMark{Job: 2, Attempt: 1}})
	s.ev(10, Event{Proc: "sink", Kind: KindDecision, Epoch: 20, Key: s.key(2), Outcome: "accepted", Position: s.pos})
	final := st
	final.Key = leasehold.EffectKey("chaos", 0, 2, 1)
	s.forgedMarker(10, ForgedFinalCopy, final, leasehold.JobMark{Job: 2, Attempt: 1, Effects: 2}, false, "accepted")
	a := Check(s.in)
	if got := checks(a); got != CheckIncomplete {
		t.Fatalf("violations %q, want %s: %v", got, CheckIncomplete, a.Violations)
	}
	if v := a.Violations[0]; v.Key != s.key(2) || !strings.Contains(v.Detail, "attempt 1") {
		t.Fatalf("violation %s", v)
	}
}
