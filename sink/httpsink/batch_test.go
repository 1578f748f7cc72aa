package httpsink_test

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink/httpsink"
)

// A relay's runner takes batches of 100 when its config sets none, not a
// stream sink runner's default of 400: a batch is acked only once its
// last request is answered. A batch the config sets is kept. The batch
// shows in the consumer's MaxAckPending, four batches.
func TestRelayBatch(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		batch, pending int
	}{{0, 400}, {20, 80}} {
		e := newEnv(t, "relaybatch")
		rc := newReceiver(t, httpsink.VerifierConfig{})
		e.barrier(1)
		seq := e.publish("hook", e.stamp(1, "k1"), []byte(`{"n":1}`), nil)
		cfg := e.runnerConfig()
		cfg.Batch = c.batch
		r := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a")}, cfg)
		r.waitPosition(t, seq)
		ctx := ctxFor(t, time.Minute)
		cons, err := e.js.Consumer(ctx, e.prefix+"-effects", cfg.Consumer)
		if err != nil {
			t.Fatal(err)
		}
		info, err := cons.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got := info.Config.MaxAckPending; got != c.pending {
			t.Errorf("Batch %d: the relay's consumer allows %d unacked, want %d", c.batch, got, c.pending)
		}
	}
}
