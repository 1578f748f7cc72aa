package streamsink_test

import (
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A pack of leasehold.MaxPackEffects empty effects, its attempt's final:
// one BatchHandler call takes all of it (a job is never split, whatever
// HandlerBatch says), each effect reported accepted once; and the same
// pack stored again is its job's duplicate, effect by effect. Closed.
func TestAttackPackOfMaxEffects(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkmax", leasehold.StampCompact)
	pl.cfg.HandlerBatch = 10
	const n = leasehold.MaxPackEffects
	keys := keysOf(pl, 2, n)
	var body []byte
	for _, k := range keys {
		body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: k})
	}
	h := stampedHeader(pl, keys[n-1], leasehold.JobMark{Job: 2, Attempt: 1, Effects: n})
	leasehold.SetPackHeader(h, n)
	r := start(t, js, pl.cfg)
	seq := pl.publish(cloneHeader(h), body)
	again := pl.publish(cloneHeader(h), body)
	pl.wait(r, again)
	calls := pl.callsOf()
	if len(calls) != 1 || len(calls[0]) != n {
		t.Fatalf("%d handler calls, want one of %d effects", len(calls), n)
	}
	reported := map[string]int{}
	for _, d := range pl.at(seq) {
		if d.Outcome == sink.Accepted {
			reported[d.Stamp.Key]++
		}
	}
	if len(reported) != n {
		t.Errorf("%d keys reported accepted at %d, want %d", len(reported), seq, n)
	}
	for k, c := range reported {
		if c != 1 {
			t.Errorf("%s reported accepted %d times", k, c)
			break
		}
	}
	dups := 0
	for _, o := range pl.outcomes(again) {
		if o == sink.Duplicate {
			dups++
		}
	}
	if dups != n {
		t.Errorf("the copy at %d: %d of its %d effects duplicates", again, dups, n)
	}
}
