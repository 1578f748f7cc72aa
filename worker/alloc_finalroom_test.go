package worker

import (
	"math"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

// In the compact form, as in the legacy one, an effect is sized before it
// is marked final: compactFinalRoom must be exactly what the largest final
// mark adds to the plain one, with a floor and an After naming any job
// when several jobs are in flight.
func TestCompactFinalRoomIsWhatTheFinalMarkAdds(t *testing.T) {
	stamp := leasehold.Stamp{Scope: "jobs", Partition: 3, Epoch: 7, Acquisition: "a1", Key: "jobs.3.9.0", Worker: "w1"}
	for _, seq := range []uint64{1, 2, 9, 10, 11, 99, 100, 101, 123456789, math.MaxUint64} {
		for _, attempt := range []uint64{1, 10, leasehold.MaxAttempt} {
			for _, floored := range []bool{false, true} {
				h := nats.Header{}
				stamp.SetHeaderAs(h, leasehold.StampCompact)
				leasehold.JobMark{Job: seq, Attempt: attempt}.SetHeader(h)
				plain := headerSize(h)
				final := leasehold.JobMark{Job: seq, Attempt: attempt, Effects: leasehold.MaxJobEffects, After: seq - 1}
				if floored {
					final.After, final.Floor, final.Floored = 1<<63, seq-1, true
				}
				final.SetHeader(h)
				if _, ok := h[leasehold.HeaderMark]; !ok || len(h) != 2 {
					t.Fatalf("the final is not in the compact form: %v", h)
				}
				if got, want := plain+compactFinalRoom(seq, floored), headerSize(h); got != want {
					t.Errorf("job %d attempt %d floored %v: plain mark %d + compactFinalRoom %d = %d bytes, the final's headers are %d", seq, attempt, floored, plain, compactFinalRoom(seq, floored), got, want)
				}
			}
		}
	}
}
