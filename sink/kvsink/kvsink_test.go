package kvsink_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestConformance(t *testing.T) {
	srv := natstest.Start(t)
	sinktest.Run(t, sinktest.Features{Durable: true, AtomicBatch: true, Dedupe: true, VerifiedEpochs: true},
		func(t *testing.T, st sinktest.Setup) sinktest.Instance {
			cfg := kvsink.Config{Bucket: st.Scope, Observer: st.Observer, Verifier: st.Verifier, Logger: quiet()}
			s, err := kvsink.New(ctxFor(t, time.Minute), srv.JetStream(t), cfg)
			if err != nil {
				t.Fatal(err)
			}
			inst := sinktest.Instance{Sink: s}
			inst.Applied = func(ctx context.Context) ([]sink.Effect, error) { return s.Effects(ctx) }
			inst.Reopen = func(ctx context.Context) (sink.Sink, error) {
				s2, err := kvsink.New(ctx, srv.JetStream(t), cfg)
				if err == nil {
					s = s2
				}
				return s2, err
			}
			return inst
		})
}

func TestConformanceCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-node cluster")
	}
	cl := natstest.StartCluster(t)
	sinktest.Run(t, sinktest.Features{AtomicBatch: true, Dedupe: true, RaceGoroutines: 6, RaceOps: 25},
		func(t *testing.T, st sinktest.Setup) sinktest.Instance {
			cfg := kvsink.Config{Bucket: st.Scope, Replicas: 3, Observer: st.Observer, Logger: quiet()}
			s, err := kvsink.New(ctxFor(t, time.Minute), cl.JetStream(t), cfg)
			if err != nil {
				t.Fatal(err)
			}
			return sinktest.Instance{Sink: s, Applied: s.Effects}
		})
}

func TestBadSubject(t *testing.T) {
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	s, err := kvsink.New(ctx, srv.JetStream(t), kvsink.Config{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	for _, subj := range []string{"", "a b", "a..b", "_leasehold.fence.1", "x*"} {
		err := s.Apply(ctx, sink.Effect{Stamp: leasehold.Stamp{Partition: 1, Epoch: 2, Key: "k"}, Subject: subj})
		if !errors.Is(err, kvsink.ErrBadSubject) {
			t.Fatalf("subject %q: %v, want ErrBadSubject", subj, err)
		}
	}
	if m, _ := s.MaxEpoch(ctx, 1); m != 0 {
		t.Fatalf("a refused subject moved the fence to %d", m)
	}
}

// Effects and their stamps can be read back through the bucket.
func TestGet(t *testing.T) {
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	s, err := kvsink.New(ctx, srv.JetStream(t), kvsink.Config{Logger: quiet(), DedupeTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	st := leasehold.Stamp{Partition: 4, Epoch: 9, Key: "order-1", Worker: "w1"}
	if err := s.Apply(ctx, sink.Effect{Stamp: st, Subject: "orders.1", Data: []byte("paid"), Header: map[string][]string{"Traceparent": {"00-1-2-01"}}}); err != nil {
		t.Fatal(err)
	}
	e, ok, err := s.Get(ctx, "orders.1")
	if err != nil || !ok || e.Stamp != st || string(e.Data) != "paid" || e.Header["Traceparent"][0] != "00-1-2-01" {
		t.Fatalf("Get = %+v, %v, %v", e, ok, err)
	}
	v, err := s.KeyValue().Get(ctx, "orders.1")
	if err != nil || string(v.Value()) != "paid" {
		t.Fatalf("kv.Get = %v, %v", v, err)
	}
}
