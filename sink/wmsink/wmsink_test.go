package wmsink_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// fenced presents a Fencer in arrival order and the store its handler
// writes to as a sink.Sink, for the conformance suite.
type fenced struct {
	f    *wmsink.Fencer
	name string

	mu      sync.Mutex
	applied []sink.Effect
}

func (x *fenced) handle(ctx context.Context, md map[string]string, e sink.Effect) error {
	return x.f.Fence(ctx, md, func() error {
		x.mu.Lock()
		x.applied = append(x.applied, e)
		x.mu.Unlock()
		return nil
	})
}

func (x *fenced) Apply(ctx context.Context, effects ...sink.Effect) error {
	for _, e := range effects {
		md := map[string]string{}
		e.Stamp.SetMetadata(md)
		if err := x.handle(ctx, md, e); err != nil {
			return err
		}
	}
	return nil
}

// Advance sends a barrier, as a worker that acquired the partition does.
// The Fencer judges it in the fence's critical section and says when it is
// below the fence (a late barrier of an earlier acquisition), which a
// worker advancing a direct sink is told as a stale error: one step, so
// that no other call can move the fence between the judgement and the
// raise.
func (x *fenced) Advance(ctx context.Context, l leasehold.Lease) error {
	if err := sink.ValidateAdvance(l); err != nil {
		return err
	}
	md := map[string]string{leasehold.HeaderBarrier: "1"}
	l.Stamp(leasehold.BarrierKey(l.Scope, l.Partition, l.Epoch)).SetMetadata(md)
	return x.handle(ctx, md, sink.Effect{})
}

func (x *fenced) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	if err := ctx.Err(); err != nil {
		return leasehold.FenceState{}, err
	}
	return x.f.State(id), nil
}

func (x *fenced) Dropped(id leasehold.FenceID) uint64 { return x.f.Dropped(id) }

func TestConformance(t *testing.T) {
	t.Parallel()
	features := sinktest.Features{VerifiedEpochs: true, Headers: true}
	sinktest.Run(t, features, func(t *testing.T, st sinktest.Setup) sinktest.Instance {
		f, err := wmsink.New(wmsink.Config{UnsafeArrivalOrder: true, Observer: st.Observer, Verifier: st.Verifier, Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		x := &fenced{f: f, name: st.Name}
		return sinktest.Instance{
			Sink: x,
			Applied: func(context.Context) ([]sink.Effect, error) {
				x.mu.Lock()
				defer x.mu.Unlock()
				return append([]sink.Effect(nil), x.applied...), nil
			},
			ApplyHeader: func(ctx context.Context, h map[string][]string, subject string, data []byte) error {
				md := map[string]string{}
				for k, v := range h {
					md[k] = v[0]
				}
				st, _ := leasehold.StampFromHeader(h)
				return x.handle(ctx, md, sink.Effect{Stamp: st, Subject: subject, Data: data})
			},
		}
	})
}

// Through a Watermill router: the handler sees the admitted messages only,
// a stale one is acked (never redelivered) and reported, a barrier raises
// the fence, and a message with bad metadata is reported and moved to the
// poison topic with leasehold's headers and trace context only.
func TestRouter(t *testing.T) {
	t.Parallel()
	for _, decorate := range []bool{false, true} {
		name := "middleware"
		if decorate {
			name = "middleware+subscriber"
		}
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			logger := watermill.NopLogger{}
			pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
			defer pubsub.Close()
			var mu sync.Mutex
			var seen []string
			handled := make(chan string, 100)
			decided := make(chan sink.Decision, 100)
			f, err := wmsink.New(wmsink.Config{
				UnsafeArrivalOrder: true,
				Logger:             quiet(),
				Observer:           sink.ObserverFunc(func(_ context.Context, d sink.Decision) { decided <- d }),
				Poison:             pubsub,
				PoisonTopic:        "poison",
			})
			if err != nil {
				t.Fatal(err)
			}
			router, err := message.NewRouter(message.RouterConfig{}, logger)
			if err != nil {
				t.Fatal(err)
			}
			poisoned, err := pubsub.Subscribe(ctx, "poison")
			if err != nil {
				t.Fatal(err)
			}
			router.AddMiddleware(f.Middleware)
			if decorate {
				router.AddSubscriberDecorators(f.Subscriber())
			}
			router.AddConsumerHandler("h", "effects", pubsub, func(msg *message.Message) error {
				mu.Lock()
				seen = append(seen, msg.Metadata.Get(leasehold.HeaderKey))
				mu.Unlock()
				handled <- msg.Metadata.Get(leasehold.HeaderKey)
				return nil
			})
			done := make(chan error, 1)
			go func() { done <- router.Run(ctx) }()
			<-router.Running()

			next := func(c chan string) string {
				select {
				case k := <-c:
					return k
				case <-ctx.Done():
					t.Fatal("the handler was not called")
					return ""
				}
			}
			pub := func(e leasehold.Epoch, key string, barrier bool) {
				m := message.NewMessage(watermill.NewUUID(), []byte(key))
				leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: e, Acquisition: "a" + e.String(), Key: key}.SetMetadata(m.Metadata)
				if barrier {
					m.Metadata.Set(leasehold.HeaderBarrier, "1")
				}
				if err := pubsub.Publish("effects", m); err != nil {
					t.Fatal(err)
				}
			}
			wait := func(o sink.Outcome, key string) sink.Decision {
				t.Helper()
				for {
					select {
					case d := <-decided:
						if d.Outcome == o && d.Stamp.Key == key {
							return d
						}
					case <-ctx.Done():
						t.Fatalf("no %s decision for %s", o, key)
					}
				}
			}
			// gochannel does not keep order between messages: publish
			// each after the previous one was decided.
			// With the subscriber filter, a message it passed is fenced
			// again by the middleware; wait for the handler itself.
			pub(5, "a", false)
			if k := next(handled); k != "a" {
				t.Fatalf("handled %s, want a", k)
			}
			pub(7, "barrier", true)
			wait(sink.Advanced, "barrier")
			pub(5, "zombie", false)
			d := wait(sink.Stale, "zombie")
			if !errors.Is(d.Err, leasehold.ErrStaleEpoch) || d.Max != 7 {
				t.Fatalf("stale decision %+v", d)
			}
			pub(7, "b", false)
			if k := next(handled); k != "b" {
				t.Fatalf("handled %s, want b", k)
			}
			bad := message.NewMessage(watermill.NewUUID(), nil)
			bad.Metadata.Set(leasehold.HeaderScope, "orders")
			bad.Metadata.Set(leasehold.HeaderAcquisition, "a7")
			bad.Metadata.Set(leasehold.HeaderPartition, "1")
			bad.Metadata.Set(leasehold.HeaderEpoch, "007")
			bad.Metadata.Set(leasehold.HeaderKey, "bad")
			bad.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
			bad.Metadata.Set("Nats-Expected-Stream", "elsewhere")
			bad.Metadata.Set("app", "private")
			if err := pubsub.Publish("effects", bad); err != nil {
				t.Fatal(err)
			}
			d = wait(sink.BadStamp, "")
			if !errors.Is(d.Err, leasehold.ErrBadStamp) {
				t.Fatalf("bad metadata: %v", d.Err)
			}
			select {
			case m := <-poisoned:
				m.Ack()
				if m.UUID != bad.UUID || !strings.Contains(m.Metadata.Get(wmsink.HeaderBadStamp), "Leasehold-Epoch") {
					t.Fatalf("poisoned message %s, reason %q", m.UUID, m.Metadata.Get(wmsink.HeaderBadStamp))
				}
				for k := range m.Metadata {
					if !strings.HasPrefix(k, "Leasehold-") && k != "traceparent" {
						t.Fatalf("the poisoned copy carries %s: %v", k, m.Metadata)
					}
				}
				if m.Metadata.Get(leasehold.HeaderEpoch) != "007" || m.Metadata.Get("traceparent") == "" {
					t.Fatalf("the poisoned copy lost the stamp or trace headers: %v", m.Metadata)
				}
			case <-ctx.Done():
				t.Fatal("the message with bad metadata did not reach the poison queue")
			}
			if err := router.Close(); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(seen) != 2 || seen[0] != "a" || seen[1] != "b" {
				t.Fatalf("the handler saw %v, want [a b]", seen)
			}
			if n := f.Dropped(leasehold.FenceID{Scope: "orders", Partition: 1}); n != 1 {
				t.Fatalf("Dropped(1) = %d, want 1: the stale message was redelivered", n)
			}
		})
	}
}
