package streamsink_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Packed messages stored again, by a forger or an operator's tool that
// copies what it finds in the log, around the runner's saved position.

// A job's pack is applied while a later job of the chain is still open
// (its first effect is in the log before the pack), so the saved position
// stays before both. Copies of the pack (other
// message IDs) are stored before and after a restart, which reads the log
// again from the saved position: the pack and every copy are the job's
// duplicates, and the open job, completed after the restart, applies.
// Every effect is applied once. Closed.
func TestAttackPackCopiesAroundSavedPosition(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkcopy", leasehold.StampCompact)
	r := start(t, js, pl.cfg)
	k3, k2 := keysOf(pl, 3, 2), keysOf(pl, 2, 3)
	open := pl.one(k3[0], "a1", leasehold.JobMark{Job: 3, Attempt: 1})
	h, body := pl.packed(k2, "a1", leasehold.JobMark{Job: 2, Attempt: 1, Effects: 3})
	packAt := pl.publish(cloneHeader(h), body)
	before := pl.publish(cloneHeader(h), body)
	pl.wait(r, before)
	want := map[string][]string{k2[0]: {"a1"}, k2[1]: {"a1"}, k2[2]: {"a1"}}
	pl.want(want)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	again, err := streamsink.New(ctxFor(t, time.Minute), js, pl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p := again.Position(); p >= open {
		t.Fatalf("saved position %d, want it before the open job at %d", p, open)
	}
	r2 := run(t, again)
	after := pl.publish(cloneHeader(h), body)
	done := pl.one(k3[1], "a1", leasehold.JobMark{Job: 3, Attempt: 1, Effects: 2, After: 2})
	pl.wait(r2, done)
	want[k3[0]], want[k3[1]] = []string{"a1"}, []string{"a1"}
	pl.want(want)
	for _, seq := range []uint64{before, after} {
		if got := pl.outcomes(seq); len(got) != 3 || got[k2[0]] != sink.Duplicate || got[k2[1]] != sink.Duplicate || got[k2[2]] != sink.Duplicate {
			t.Errorf("decisions of the copy at %d: %v, want each key Duplicate", seq, got)
		}
	}
	// The pack itself: Accepted, then, read again after the restart, its
	// job's duplicate.
	accepted := map[string]bool{}
	for _, d := range pl.at(packAt) {
		if d.Outcome == sink.Accepted {
			accepted[d.Stamp.Key] = true
		}
	}
	if len(accepted) != 3 {
		t.Errorf("the pack at %d: accepted %v, want its three keys", packAt, accepted)
	}
}

// A stale pack (its epoch below the fence's) whose effects each carry
// leasehold.HeaderReplayOf, as a replayed dead letter does. A packed
// message is never a replay (`leasehold dlq replay --sink` stores one
// effect alone, and dead letters never carry Leasehold-Pack), yet each of
// its effects was taken for a refused replay and filed again as a dead
// letter: one log message of a forger made as many dead letters, each an
// operator's alarm, as it packs effects (up to leasehold.MaxPackEffects).
// It must make none: its effects are refused as stale, as any are.
func TestAttackStalePackPosingAsReplays(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkrefile", leasehold.StampCompact)
	r := start(t, js, pl.cfg)
	// Epoch 2 takes the fence.
	h := nats.Header{}
	pl.stamp(2, "raise").SetHeaderAs(h, pl.form)
	pl.wait(r, pl.publish(h, []byte("raise")))
	const n = 64
	var body []byte
	var keys []string
	for i := range n {
		k := pl.key(5, i)
		keys = append(keys, k)
		body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: k, Header: map[string][]string{leasehold.HeaderReplayOf: {fmt.Sprintf("pkrefile-sink-dlq %d", i+1)}}, Data: []byte("x")})
	}
	ph := stampedHeader(pl, keys[n-1], leasehold.JobMark{Job: 5, Attempt: 1, Effects: n})
	leasehold.SetPackHeader(ph, n)
	seq := pl.publish(ph, body)
	pl.wait(r, seq)
	for k, o := range pl.outcomes(seq) {
		if o != sink.Stale {
			t.Errorf("%s: %v, want stale", k, o)
		}
	}
	ctx := ctxFor(t, time.Minute)
	s, err := js.Stream(ctx, "pkrefile-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 0 {
		t.Fatalf("one stale pack of %d effects made %d dead letters, want none", n, info.State.Msgs)
	}
}
