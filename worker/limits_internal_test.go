package worker

import (
	"fmt"
	"math"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

// An effect is sized before it is marked final: finalRoom must be exactly
// what the largest final mark adds, with a floor and an After naming any
// job when several jobs are in flight.
func TestFinalRoomIsWhatTheFinalMarkAdds(t *testing.T) {
	for _, seq := range []uint64{1, 2, 9, 10, 11, 99, 100, 101, 123456789, math.MaxUint64} {
		for _, attempt := range []uint64{1, 10, leasehold.MaxAttempt} {
			for _, floored := range []bool{false, true} {
				h := nats.Header{leasehold.HeaderKey: {"k"}}
				leasehold.JobMark{Job: seq, Attempt: attempt}.SetHeader(h)
				plain := headerSize(h)
				final := leasehold.JobMark{Job: seq, Attempt: attempt, Effects: leasehold.MaxJobEffects, After: seq - 1}
				if floored {
					final.After, final.Floor, final.Floored = 1<<63, seq-1, true
				}
				final.SetHeader(h)
				if got, want := plain+finalRoom(seq, floored), headerSize(h); got != want {
					t.Errorf("job %d attempt %d floored %v: plain mark %d + finalRoom %d = %d bytes, the final's headers are %d", seq, attempt, floored, plain, finalRoom(seq, floored), got, want)
				}
			}
		}
	}
}

// An attempt's outputs are found by subject however many it uses, in the
// order the subjects were first used.
func TestJobOutputsBySubject(t *testing.T) {
	j := &Job{}
	const n = 3 * indexOutputs
	for round := range 2 {
		for i := range n {
			s := fmt.Sprintf("out.%d", i)
			o := j.output(s)
			if (o == nil) != (round == 0) {
				t.Fatalf("round %d: output of %s: %v", round, s, o)
			}
			if o == nil {
				o = j.addOutput(s)
			}
			o.count++
		}
	}
	if len(j.outs) != n {
		t.Fatalf("%d outputs, want %d", len(j.outs), n)
	}
	for i, o := range j.outs {
		if want := fmt.Sprintf("out.%d", i); o.subject != want || o.count != 2 {
			t.Errorf("output %d: %s with %d effects, want %s with 2", i, o.subject, o.count, want)
		}
	}
}
