package wmstamp_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker/wmstamp"
)

// lockLease takes the named lock in a fresh lease bucket.
func lockLease(t *testing.T, ctx context.Context, name string) *coordinator.Lease {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "wm-locks", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c, err := coordinator.New(b, coordinator.Config{Worker: "router-1"})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.TryLock(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	return l
}

// A Watermill Router handler, which has no leasehold job, publishes through
// a stamping publisher with Config.Lease: its messages carry the lease's
// stamp, and keys derived from the message it handles, so that handling
// that message again (here after a failure and a redelivery) gives them
// the same keys.
func TestRouterHandlerStampsWithLease(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := lockLease(t, ctx, "billing")
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubsub.Close()
	out, err := pubsub.Subscribe(ctx, "out")
	if err != nil {
		t.Fatal(err)
	}
	stamping := wmstamp.Decorator(wmstamp.Config{Lease: l})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddPublisherDecorators(stamping)
	router.AddMiddleware(wmstamp.Middleware)
	pub, err := stamping(pubsub)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	deliveries := 0
	router.AddHandler("bill", "in", pubsub, "out", pubsub, func(msg *message.Message) ([]*message.Message, error) {
		// One message published by the handler itself, one returned.
		if err := pub.Publish("out", message.NewMessageWithContext(msg.Context(), watermill.NewUUID(), []byte("direct"))); err != nil {
			return nil, err
		}
		mu.Lock()
		deliveries++
		first := deliveries == 1
		mu.Unlock()
		if first {
			return nil, errors.New("the database blinked")
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("returned"))}, nil
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	if err := pubsub.Publish("in", message.NewMessage("invoice-7", []byte("bill"))); err != nil {
		t.Fatal(err)
	}
	// The first delivery published "direct" and failed; the second
	// published "direct" again and returned "returned".
	info := l.Info()
	var got []leasehold.Stamp
	var payloads []string
	for range 3 {
		select {
		case m := <-out:
			m.Ack()
			s, err := leasehold.StampFromMetadata(m.Metadata)
			if err != nil {
				t.Fatalf("message %s: %v", m.UUID, err)
			}
			got = append(got, s)
			payloads = append(payloads, string(m.Payload))
		case <-ctx.Done():
			t.Fatalf("got %v so far", payloads)
		}
	}
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	keys := map[string][]string{}
	for i, s := range got {
		if s.Scope != info.Scope || s.Partition != info.Partition || s.Epoch != info.Epoch || s.Acquisition != info.Acquisition || s.Worker != "router-1" {
			t.Fatalf("stamp %+v, want lease %+v", s, info)
		}
		keys[payloads[i]] = append(keys[payloads[i]], s.Key)
	}
	base := info.Scope + "." + info.Partition.String() + ".wm.invoice-7."
	if d := keys["direct"]; len(d) != 2 || d[0] != base+"0" || d[1] != base+"0" {
		t.Fatalf("the handler's own message was keyed %v on its two deliveries, want %s0 both times", d, base)
	}
	if r := keys["returned"]; len(r) != 1 || r[0] != base+"1" {
		t.Fatalf("the returned message was keyed %v, want %s1", r, base)
	}
}

// Once the lease is gone, a publish under it is refused and nothing is
// published; a failed publish can be retried under the same keys.
func TestLeasePublishRefusedAfterRelease(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := lockLease(t, ctx, "reports")
	fl := &flaky{fails: 1}
	pub := wmstamp.NewPublisher(fl, wmstamp.Config{Lease: l})
	m := message.NewMessage("report-1", nil)
	if err := pub.Publish("out", m); !errors.Is(err, errAway) {
		t.Fatalf("first publish: %v, want the broker's error", err)
	}
	if err := pub.Publish("out", m); err != nil {
		t.Fatal(err)
	}
	want := l.Info().Scope + ".0.wm.report-1"
	if len(fl.sent) != 1 || fl.sent[0].Metadata.Get(leasehold.HeaderKey) != want {
		t.Fatalf("sent %d messages, key %q; want one keyed %s", len(fl.sent), fl.sent[0].Metadata.Get(leasehold.HeaderKey), want)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	err := pub.Publish("out", message.NewMessage("report-2", nil))
	if !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("publish after release: %v, want ErrLeaseLost", err)
	}
	if len(fl.sent) != 1 {
		t.Fatalf("%d messages sent; the one after release must not be", len(fl.sent))
	}
}
