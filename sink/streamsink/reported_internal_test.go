package streamsink

import (
	"testing"

	"github.com/leasehold/leasehold/sink"
)

// A batch whose save failed is decided again by the same runner: what it
// reported the first time is not reported again, unless the decision
// changed, and nothing at or below the saved position is kept.
func TestReportedDecisionsOfAnUnsavedBatchAreNotReportedTwice(t *testing.T) {
	r := &Runner{saved: 10}
	out := func(seq uint64, o sink.Outcome, report bool) outcome {
		return outcome{m: &logMsg{seq: seq}, d: sink.Decision{Outcome: o}, report: report}
	}
	first := []outcome{out(11, sink.Accepted, true), out(12, sink.Stale, true), out(13, sink.Accepted, false)}
	for _, o := range first {
		if r.reportedBefore(o) {
			t.Fatalf("position %d: reported before anything was", o.m.seq)
		}
	}
	r.keepReported(first)
	for _, tc := range []struct {
		o    outcome
		want bool
	}{
		{out(11, sink.Accepted, true), true},
		{out(12, sink.Stale, true), true},
		{out(12, sink.Accepted, true), false}, // decided otherwise this time
		{out(13, sink.Accepted, true), false}, // not reported the first time
		{out(14, sink.Accepted, true), false},
	} {
		if got := r.reportedBefore(tc.o); got != tc.want {
			t.Errorf("position %d %v: reportedBefore = %v, want %v", tc.o.m.seq, tc.o.d.Outcome, got, tc.want)
		}
	}
	r.saved = 11
	r.keepReported(nil)
	if _, ok := r.unsaved[11]; ok || len(r.unsaved) != 1 {
		t.Errorf("kept %v with the saved position at 11, want only 12", r.unsaved)
	}
}
