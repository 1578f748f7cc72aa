package streamsink_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A save of the runner's progress whose request the connection loses (the
// connection drops with it in flight, as when a server restarts) is tried
// again as soon as the connection is back. With a request (kv.Update) the
// runner waited out its whole RequestTimeout, here 10 minutes, holding
// every effect behind it; the test gives it one.
func TestSaveLostWithTheConnectionIsRetriedAtOnce(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	ctx := ctxFor(t, 2*time.Minute)
	px := natstest.NewProxy(t, srv.URL())
	nc, err := nats.Connect(px.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cfg := streamsink.Config{Prefix: "lostsave", Provision: true, RequestTimeout: 10 * time.Minute, MaxBackoff: 50 * time.Millisecond, Logger: quiet()}
	r, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The batch the test marks is held at the proxy from its delivery on:
	// what the runner sends next is its save. Once that is held, the
	// connection is cut with it.
	var hold atomic.Bool
	cut := make(chan struct{})
	r.SetHook(func(point string) error {
		if point == "delivered" && hold.CompareAndSwap(true, false) {
			px.Freeze()
			go func() {
				defer close(cut)
				for px.HoldingSent() == 0 {
					select {
					case <-ctx.Done():
						return
					case <-time.After(time.Millisecond):
					}
				}
				px.Cut()
				px.Thaw()
			}()
		}
		return nil
	})
	run(t, r)
	direct := srv.JetStream(t)
	first := publishStamped(t, ctx, direct, "lostsave.out.x", "lostsave", 3, "before", false)
	if err := r.WaitPosition(ctx, first); err != nil {
		t.Fatal(err)
	}
	hold.Store(true)
	held := publishStamped(t, ctx, direct, "lostsave.out.x", "lostsave", 4, "held", false)
	select {
	case <-cut:
	case <-ctx.Done():
		t.Fatal("the runner's save never reached the proxy")
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := r.WaitPosition(wctx, held); err != nil {
		t.Fatalf("the batch whose save the connection lost: %v (at %d of %d)", err, r.Position(), held)
	}
	after := publishStamped(t, ctx, direct, "lostsave.out.x", "lostsave", 4, "after", false)
	if err := r.WaitPosition(ctx, after); err != nil {
		t.Fatal(err)
	}
}
