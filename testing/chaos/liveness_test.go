package chaos

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
)

const bound = 7 * time.Second // a 2s TTL + 5s

// flow builds a one-partition history in which worker a holds partition 0
// at epoch 10 from 0s and every job's effect is in the effect log, accepted
// by the runner; enqueue and apply place jobs and their applications.
type flow struct{ *story }

func newFlow() flow {
	s := &story{t0: time.Unix(1_800_000_000, 0), in: Input{Prefix: "chaos", Final: map[string]leasehold.Stamp{}, LivenessBound: bound}}
	s.ev(0, Event{Proc: "a", Kind: KindAcquire, Epoch: 10})
	s.barrier(0, "a", 10)
	return flow{s}
}

func (f flow) enqueue(sec int, seq uint64) {
	f.in.Jobs = append(f.in.Jobs, Job{Partition: 0, Seq: seq, ID: "job"})
	f.ev(sec, Event{Proc: "producer", Kind: KindEnqueue, Seq: seq, JobID: "job"})
}

// emit puts job seq's effect into the log, accepted by the runner, without
// applying it.
func (f flow) emit(sec int, proc string, epoch leasehold.Epoch, seq uint64) {
	f.pos++
	st := leasehold.Stamp{Partition: 0, Epoch: epoch, Key: f.key(seq), Worker: proc}
	f.in.Log = append(f.in.Log, LogEntry{Position: f.pos, Stamp: st})
	f.ev(sec, Event{Proc: proc, Kind: KindEffect, Epoch: uint64(epoch), Key: st.Key, Seq: seq})
	f.ev(sec, Event{Proc: "sink", Kind: KindDecision, Epoch: uint64(epoch), Key: st.Key, Outcome: "accepted", Max: uint64(epoch), Position: f.pos})
}

// apply records the sink applying job seq's effect.
func (f flow) apply(sec int, epoch leasehold.Epoch, seq uint64) {
	st := leasehold.Stamp{Partition: 0, Epoch: epoch, Key: f.key(seq), Worker: "a"}
	f.in.Final[st.Key] = st
	f.ev(sec, Event{Proc: "sink", Kind: KindDecision, Reason: ApplyStage, Epoch: uint64(epoch), Key: st.Key, Outcome: "accepted"})
}

func (f flow) job(enq, done int, seq uint64) {
	f.enqueue(enq, seq)
	f.emit(enq, "a", 10, seq)
	f.apply(done, 10, seq)
}

func stallOf(t *testing.T, a *Analysis) time.Duration {
	t.Helper()
	return time.Duration(a.Stalls["0"] * float64(time.Millisecond))
}

// A sink that stops applying while the worker holds the partition and
// commits: a stall to the end of the run, a liveness violation, and each
// job it left named as not yet applied, not lost.
func TestLivenessFindsAStalledSink(t *testing.T) {
	f := newFlow()
	f.job(1, 2, 1)
	f.enqueue(3, 2)
	f.emit(3, "a", 10, 2)
	f.enqueue(5, 3)
	f.emit(5, "a", 10, 3)
	f.ev(6, Event{Proc: "a", Kind: KindCommit, Epoch: 10, Seq: 3})
	f.in.End = f.at(70)
	a := Check(f.in)
	if got := stallOf(t, a); got != 67*time.Second || a.LongestStallMs != 67000 || a.LongestStallPartition != "0" {
		t.Fatalf("stall %v, figures %+v", got, a.Figures)
	}
	if checks(a) != CheckLiveness+","+CheckNotApplied+","+CheckNotApplied || a.JobsLost != 0 || a.JobsNotApplied != 2 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
	for _, v := range a.Violations {
		t.Log(v)
	}
	if v := a.Violations[0]; !strings.Contains(v.String(), "made no progress for 1m7s") {
		t.Fatalf("liveness violation: %s", v)
	}
	if v := a.Violations[1]; !strings.Contains(v.String(), "not yet applied when the run ended") || !strings.Contains(v.String(), "waits in the effect log") {
		t.Fatalf("late job: %s", v)
	}

	// Without a bound the stall is measured and not judged.
	f.in.LivenessBound = 0
	if a := Check(f.in); checks(a) != CheckNotApplied+","+CheckNotApplied || a.LongestStallMs != 67000 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
}

// Lost and late, told apart: a job whose effect waits in the log, or that
// nobody has committed past, is late; one whose only effect sits behind a
// newer barrier, with progress committed past it, is lost.
func TestLivenessTellsLostFromLate(t *testing.T) {
	f := newFlow()
	f.enqueue(1, 1) // never handled, nothing committed past it
	f.in.End = f.at(3)
	if a := Check(f.in); checks(a) != CheckNotApplied || !strings.Contains(a.Violations[0].Detail, "no worker committed past it") {
		t.Fatalf("violations %v", a.Violations)
	}

	f = newFlow()
	f.enqueue(1, 1)
	f.ev(2, Event{Proc: "b", Kind: KindAcquire, Epoch: 20})
	f.barrier(2, "b", 20)
	f.emit(3, "a", 10, 1) // a zombie's effect, behind b's barrier
	f.in.Events[len(f.in.Events)-1].Outcome = "stale"
	f.ev(4, Event{Proc: "a", Kind: KindCommit, Epoch: 10, Seq: 1})
	f.in.End = f.at(5)
	a := Check(f.in)
	if checks(a) != CheckLost || a.JobsLost != 1 || a.JobsNotApplied != 0 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.Figures)
	}
}

// Time the faults take away does not count: a holder paused, no holder
// (a fail-over after a loss or a kill), the server down, the sink down.
func TestLivenessLeavesOutFaults(t *testing.T) {
	for _, c := range []struct {
		name  string
		build func(f flow)
	}{
		{"holder paused", func(f flow) {
			f.ev(2, Event{Proc: "a", Kind: KindFault, Reason: FaultPause})
			f.ev(40, Event{Proc: "a", Kind: KindFault, Reason: markResume})
		}},
		{"lease lost, then acquired again", func(f flow) {
			f.ev(2, Event{Proc: "a", Kind: KindLose, Epoch: 10})
			f.ev(40, Event{Proc: "a", Kind: KindAcquire, Epoch: 30})
		}},
		{"holder killed", func(f flow) {
			f.ev(2, Event{Proc: "a", Kind: KindFault, Reason: FaultKill})
			f.ev(40, Event{Proc: "b", Kind: KindAcquire, Epoch: 30})
		}},
		{"server down", func(f flow) {
			f.ev(2, Event{Proc: "chaos-a", Kind: KindFault, Reason: FaultNATSRestart})
			f.ev(40, Event{Proc: "chaos-a", Kind: KindFault, Reason: markNodeRestart})
		}},
		{"sink down", func(f flow) {
			f.ev(2, Event{Proc: sinkName, Kind: KindFault, Reason: FaultSinkKill})
			f.ev(40, Event{Proc: sinkName, Kind: KindFault, Reason: markRestart})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFlow()
			f.enqueue(1, 1)
			f.emit(1, "a", 10, 1)
			c.build(f)
			f.apply(41, 10, 1)
			a := Check(f.in)
			if got := stallOf(t, a); got != 2*time.Second || !a.OK() {
				t.Fatalf("stall %v, violations %v", got, a.Violations)
			}
		})
	}
}

// Progress ends a stall: a partition that applies a job every 5s while
// others wait stalls 5s at most, however long its backlog lasts.
func TestLivenessProgressEndsAStall(t *testing.T) {
	f := newFlow()
	for i := range 20 {
		f.enqueue(1, uint64(i+1))
		f.emit(1, "a", 10, uint64(i+1))
	}
	for i := range 20 {
		f.apply(1+5*(i+1), 10, uint64(i+1))
	}
	a := Check(f.in)
	if got := stallOf(t, a); got != 5*time.Second || !a.OK() {
		t.Fatalf("stall %v, violations %v", got, a.Violations)
	}
	// The same backlog applied in one go after 30s is one stall of 30s.
	f = newFlow()
	for i := range 20 {
		f.job(1, 31, uint64(i+1))
	}
	a = Check(f.in)
	if got := stallOf(t, a); got != 30*time.Second || slices.IndexFunc(a.Violations, func(v Violation) bool { return v.Check == CheckLiveness }) < 0 {
		t.Fatalf("stall %v, violations %q", got, checks(a))
	}
}

func TestSpans(t *testing.T) {
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	got := subtract([]span{{at(0), at(10)}, {at(5), at(15)}, {at(20), at(30)}}, []span{{at(2), at(4)}, {at(12), at(22)}, {at(29), at(40)}})
	want := []span{{at(0), at(2)}, {at(4), at(12)}, {at(22), at(29)}}
	if !slices.Equal(got, want) {
		t.Fatalf("subtract: %v, want %v", got, want)
	}
	if d := overlap(want, at(1), at(25)); d != 12*time.Second {
		t.Fatalf("overlap %v", d)
	}
}
