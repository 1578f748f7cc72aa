package streamsink_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A destination that cannot serve for a while (a database restarting,
// whose errors pgsink marks sink.ErrUnavailable) blames no effect: its
// failures are retried past MaxDeliveries, one effect at a time or the
// batch whole, and the effect is applied once it answers, not moved to
// the dead-letter stream.
func TestDeadLetterNotForAnUnavailableDestination(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	eachAndBatch(t, func(t *testing.T, batch bool, name string) {
		ctx := ctxFor(t, time.Minute)
		js := srv.JetStream(t)
		prefix := "down" + name
		failures := 0
		var got []string
		apply := func(effects []sink.Effect) error {
			if failures < 12 {
				failures++
				return fmt.Errorf("write %d effects: connection refused: %w", len(effects), sink.ErrUnavailable)
			}
			for _, e := range effects {
				got = append(got, e.Stamp.Key)
			}
			return nil
		}
		rec := &positions{}
		cfg := streamsink.Config{Prefix: prefix, Provision: true, MaxDeliveries: 3, MaxBackoff: time.Millisecond, Observer: rec, Logger: quiet()}
		if batch {
			cfg.BatchHandler = func(_ context.Context, effects []sink.Effect) error { return apply(effects) }
		} else {
			cfg.Handler = func(_ context.Context, e sink.Effect) error { return apply([]sink.Effect{e}) }
		}
		r, err := streamsink.New(ctx, js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		seq := publishStamped(t, ctx, js, prefix+".out.p0", prefix, 1, "k0", false)
		rr := run(t, r)
		if err := rr.WaitPosition(ctx, seq); err != nil {
			t.Fatal(err)
		}
		if d, _ := rec.at(seq); d.Outcome != sink.Accepted {
			t.Fatalf("decision at %d: %v (%v), want accepted after %d failures of an unavailable destination", seq, d.Outcome, d.Err, failures)
		}
		if len(got) != 1 || got[0] != "k0" {
			t.Fatalf("the destination took %v, want k0 once", got)
		}
	})
}
