package streamsink

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// The effects of a packed message share its log position: delivery tries
// and dead-lettering are each effect's own. A batch whose save failed is
// delivered again; an effect dead-lettered the first time is not tried or
// moved again, and the others of its message are delivered, never taken
// for dead-lettered with it. The failing effect first, and last.
func TestPackedEffectsTriedApart(t *testing.T) {
	srv := natstest.Start(t)
	for _, bad := range []int{0, 2} {
		ctx := testCtx(t, time.Minute)
		js := srv.JetStream(t)
		prefix := "tries" + string(rune('a'+bad))
		keys := []string{prefix + ".0.9.0", prefix + ".0.9.1", prefix + ".0.9.2"}
		var mu sync.Mutex
		var calls []string
		cfg := Config{Prefix: prefix, Provision: true, MaxDeliveries: 2, MaxBackoff: time.Millisecond, Logger: slog.New(slog.DiscardHandler),
			Handler: func(_ context.Context, e sink.Effect) error {
				mu.Lock()
				defer mu.Unlock()
				calls = append(calls, e.Stamp.Key)
				if e.Stamp.Key == keys[bad] {
					return errors.New("the destination refuses this one")
				}
				return nil
			}}
		r, err := New(ctx, js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		batch := func() []outcome {
			outs := make([]outcome, len(keys))
			for i, k := range keys {
				st := leasehold.Stamp{Scope: prefix, Epoch: 1, Acquisition: "a1", Key: k}
				outs[i] = outcome{m: &logMsg{seq: 10, subject: prefix + ".out.0", header: nats.Header{}, data: []byte(k)},
					d: sink.Decision{Outcome: sink.Accepted, Stamp: st, Position: 10}, deliver: true, report: true, job: 9, ctx: ctx}
			}
			return outs
		}
		for round := range 2 {
			mu.Lock()
			calls = nil
			mu.Unlock()
			outs := batch()
			if err := r.deliver(ctx, outs); err != nil {
				t.Fatal(err)
			}
			want := []string{keys[0], keys[1], keys[2]}
			if round == 0 {
				want = slices.Insert(want, bad+1, keys[bad])
			} else {
				want = slices.Delete(want, bad, bad+1)
			}
			mu.Lock()
			got := slices.Clone(calls)
			mu.Unlock()
			if !slices.Equal(got, want) {
				t.Errorf("failing effect %d, round %d: handed over %v, want %v", bad, round, got, want)
			}
			for i := range outs {
				want := sink.Accepted
				if i == bad {
					want = sink.DeadLettered
				}
				if outs[i].d.Outcome != want {
					t.Errorf("failing effect %d, round %d: effect %d %v, want %v", bad, round, i, outs[i].d.Outcome, want)
				}
			}
		}
		s, err := js.Stream(ctx, r.cfg.DeadLetter)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs != 1 {
			t.Errorf("failing effect %d: %d dead letters, want 1", bad, info.State.Msgs)
		}
	}
}

// What a runner reported in a batch whose save failed is kept per effect:
// two effects of one packed message, decided otherwise, are each reported
// once.
func TestPackedReportedPerEffect(t *testing.T) {
	r := &Runner{saved: 10}
	out := func(key string, o sink.Outcome) outcome {
		return outcome{m: &logMsg{seq: 11}, d: sink.Decision{Outcome: o, Stamp: leasehold.Stamp{Key: key}}, report: true}
	}
	r.keepReported([]outcome{out("a", sink.Duplicate), out("b", sink.Accepted)})
	for _, tc := range []struct {
		o    outcome
		want bool
	}{
		{out("a", sink.Duplicate), true},
		{out("b", sink.Accepted), true},
		{out("a", sink.Accepted), false},
		{out("c", sink.Accepted), false},
	} {
		if got := r.reportedBefore(tc.o); got != tc.want {
			t.Errorf("key %s %v: reportedBefore = %v, want %v", tc.o.d.Stamp.Key, tc.o.d.Outcome, got, tc.want)
		}
	}
}
