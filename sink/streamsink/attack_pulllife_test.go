package streamsink_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A runner stopped while its pull is open on the server (a long
// FetchWait keeps it open), and another started at once on the same
// consumer: what the log gets next must reach the new runner, not the
// old one's pull, whose inbox nobody listens to any more and whose
// messages would wait for the ack wait (ten minutes here).
func TestRunnerRestartedAtOnceGetsTheNextEffects(t *testing.T) {
	t.Parallel()
	for _, wait := range []time.Duration{200 * time.Millisecond, 2 * time.Second, time.Hour} {
		t.Run(wait.String(), func(t *testing.T) {
			srv := natstest.Start(t)
			ctx := ctxFor(t, time.Minute)
			js := srv.JetStream(t)
			prefix := fmt.Sprintf("atkrestart%d", wait.Milliseconds())
			cfg := streamsink.Config{Prefix: prefix, Provision: true, Batch: 4, FetchWait: wait, AckWait: 10 * time.Minute, Logger: quiet()}
			first := start(t, js, cfg)
			seq := publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, "k0", false)
			if err := first.WaitPosition(ctx, seq); err != nil {
				t.Fatal(err)
			}
			if err := first.stop(); err != nil {
				t.Fatal(err)
			}
			next := start(t, srv.JetStream(t), cfg)
			var last uint64
			for i := 1; i <= 20; i++ {
				last = publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, fmt.Sprintf("k%d", i), false)
			}
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			if err := next.WaitPosition(wctx, last); err != nil {
				cons, _ := js.Consumer(ctx, prefix+"-effects", prefix+"-sink")
				info, _ := cons.Info(ctx)
				t.Fatalf("the runner started after a stop stands at %d of %d after 20 s; Ready = %v; consumer: %d acks pending, %d undelivered, %d pulls waiting",
					next.Position(), last, next.Ready(ctx), info.NumAckPending, info.NumPending, info.NumWaiting)
			}
		})
	}
}

// The server restarts while the runner's pull is open: the pull is gone
// with it. The runner must notice (a missed heartbeat, or its pull's
// expiry) and pull again, and handle what the log gets after the restart
// long before the ack wait.
func TestServerRestartMidPull(t *testing.T) {
	t.Parallel()
	for _, wait := range []time.Duration{200 * time.Millisecond, 2 * time.Second} {
		t.Run(wait.String(), func(t *testing.T) {
			srv := natstest.Start(t, natstest.Listen())
			ctx := ctxFor(t, time.Minute)
			js := srv.JetStream(t)
			prefix := fmt.Sprintf("atksrvrestart%d", wait.Milliseconds())
			cfg := streamsink.Config{Prefix: prefix, Provision: true, Batch: 4, FetchWait: wait, AckWait: 10 * time.Minute, MaxBackoff: 100 * time.Millisecond, Logger: quiet()}
			r := start(t, js, cfg)
			seq := publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, "k0", false)
			if err := r.WaitPosition(ctx, seq); err != nil {
				t.Fatal(err)
			}
			srv.Restart(t)
			natstest.WaitJetStream(t, js, 20*time.Second)
			var last uint64
			for i := 1; i <= 20; i++ {
				last = publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, fmt.Sprintf("k%d", i), false)
			}
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			if err := r.WaitPosition(wctx, last); err != nil {
				t.Fatalf("after a server restart the runner stands at %d of %d after 20 s; Ready = %v", r.Position(), last, r.Ready(ctx))
			}
		})
	}
}

// The consumer is deleted under the runner. The runner must either take
// up the log again (it provisions its consumer) or say that it cannot,
// in Ready, within its StallAfter.
func TestConsumerDeletedUnderTheRunner(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	const prefix = "atkcondel"
	cfg := streamsink.Config{Prefix: prefix, Provision: true, Batch: 4, FetchWait: 200 * time.Millisecond, StallAfter: 2 * time.Second, MaxBackoff: 100 * time.Millisecond, Logger: quiet()}
	r := start(t, js, cfg)
	seq := publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, "k0", false)
	if err := r.WaitPosition(ctx, seq); err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteConsumer(ctx, prefix+"-effects", prefix+"-sink"); err != nil {
		t.Fatal(err)
	}
	last := publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, "k1", false)
	deadline := time.Now().Add(cfg.StallAfter + 5*time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if r.Position() >= last {
			return // it took up the log again
		}
		if err := r.Ready(ctx); err != nil {
			t.Logf("Ready reports: %v", err)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the consumer was deleted: the runner stands at %d of %d and Ready has said nothing for %v (StallAfter %v)", r.Position(), last, cfg.StallAfter+5*time.Second, cfg.StallAfter)
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-tick.C:
		}
	}
}

// A handler slower than the pulls last: every pull expires while the
// runner is busy with the batch before. Each effect is applied once and
// in order, and none waits for the ack wait (ten minutes here).
func TestSlowHandlerShortFetchWait(t *testing.T) {
	t.Parallel()
	for _, wait := range []time.Duration{20 * time.Millisecond, time.Second} {
		t.Run(wait.String(), func(t *testing.T) {
			srv := natstest.Start(t)
			ctx := ctxFor(t, time.Minute)
			js := srv.JetStream(t)
			prefix := fmt.Sprintf("atkslow%d", wait.Milliseconds())
			var applied []string
			cfg := streamsink.Config{Prefix: prefix, Provision: true, Batch: 4, FetchWait: wait, AckWait: 10 * time.Minute, Logger: quiet(),
				Handler: func(_ context.Context, e sink.Effect) error {
					// The handler's slowness is the load, not a timing the
					// test asserts.
					time.Sleep(min(3*wait, 1200*time.Millisecond))
					applied = append(applied, e.Stamp.Key)
					return nil
				}}
			r := start(t, js, cfg)
			var last uint64
			var want []string
			n := 12
			if wait >= time.Second {
				n = 5 // each longer than the pull and two heartbeats
			}
			for i := range n {
				k := fmt.Sprintf("k%02d", i)
				want = append(want, k)
				last = publishStamped(t, ctx, js, prefix+".out.x", prefix, 3, k, false)
			}
			wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
			defer cancel()
			if err := r.WaitPosition(wctx, last); err != nil {
				t.Fatalf("a slow handler: the runner stands at %d of %d after 40 s; Ready = %v", r.Position(), last, r.Ready(ctx))
			}
			r.stop()
			if fmt.Sprint(applied) != fmt.Sprint(want) {
				t.Fatalf("applied %v, want %v", applied, want)
			}
		})
	}
}

// Effects near the server's max payload, several batches of them: every
// one reaches the handler, none waits for the ack wait.
func TestHugeEffectsNearMaxPayload(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	const prefix = "atkhuge"
	var applied atomic.Int32
	cfg := streamsink.Config{Prefix: prefix, Provision: true, Batch: 4, FetchWait: 2 * time.Second, AckWait: 10 * time.Minute, Logger: quiet(),
		Handler: func(_ context.Context, e sink.Effect) error {
			applied.Add(1)
			return nil
		}}
	r := start(t, js, cfg)
	maxPayload := js.Conn().MaxPayload()
	var last uint64
	for i := range 16 {
		h := nats.Header{}
		leasehold.Stamp{Scope: prefix, Epoch: 3, Acquisition: "a3", Key: fmt.Sprintf("k%d", i), Worker: "w3"}.SetHeader(h)
		data := make([]byte, int(maxPayload)-1024)
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: prefix + ".out.x", Header: h, Data: data})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := r.WaitPosition(wctx, last); err != nil {
		t.Fatalf("effects near max payload: the runner stands at %d of %d after 30 s; Ready = %v", r.Position(), last, r.Ready(ctx))
	}
	if n := applied.Load(); n != 16 {
		t.Fatalf("applied %d of 16", n)
	}
}
