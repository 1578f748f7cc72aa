package kvsink_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	sinktest.Run(t, sinktest.Features{Durable: true, AtomicBatch: true, Dedupe: true, VerifiedEpochs: true, Parallel: true},
		func(t *testing.T, st sinktest.Setup) sinktest.Instance {
			cfg := kvsink.Config{Bucket: st.Name, Observer: st.Observer, Verifier: st.Verifier, Logger: quiet()}
			s, err := kvsink.New(ctxFor(t, time.Minute), srv.JetStream(t), cfg)
			if err != nil {
				t.Fatal(err)
			}
			inst := sinktest.Instance{Sink: s}
			inst.Applied = func(ctx context.Context) ([]sink.Effect, error) { return s.Effects(ctx) }
			inst.Reopen = func(ctx context.Context) (sink.Sink, error) {
				s2, err := kvsink.New(ctx, srv.JetStream(t), cfg)
				if err != nil {
					return nil, err
				}
				s = s2
				return s2, nil
			}
			return inst
		})
}

func TestConformanceCluster(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a three-node cluster")
	}
	cl := natstest.StartCluster(t)
	sinktest.Run(t, sinktest.Features{AtomicBatch: true, Dedupe: true, RaceGoroutines: 6, RaceOps: 25, Parallel: true},
		func(t *testing.T, st sinktest.Setup) sinktest.Instance {
			cfg := kvsink.Config{Bucket: st.Name, Replicas: 3, Observer: st.Observer, Logger: quiet()}
			s, err := kvsink.New(ctxFor(t, time.Minute), cl.JetStream(t), cfg)
			if err != nil {
				t.Fatal(err)
			}
			return sinktest.Instance{Sink: s, Applied: s.Effects}
		})
}

func TestBadSubject(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	s, err := kvsink.New(ctx, srv.JetStream(t), kvsink.Config{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	for _, subj := range []string{"", "a b", "a..b", "_leasehold.fence.1", "x*"} {
		err := s.Apply(ctx, sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 2, Acquisition: "a2", Key: "k"}, Subject: subj})
		if !errors.Is(err, kvsink.ErrBadSubject) {
			t.Fatalf("subject %q: %v, want ErrBadSubject", subj, err)
		}
	}
	if f, err := s.Fence(ctx, leasehold.FenceID{Scope: "orders", Partition: 1}); err != nil || f.Epoch != 0 {
		t.Fatalf("a refused subject moved the fence to %+v (%v)", f, err)
	}
}

// Effects and their stamps can be read back through the bucket.
func TestGet(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	s, err := kvsink.New(ctx, srv.JetStream(t), kvsink.Config{Logger: quiet(), DedupeTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	st := leasehold.Stamp{Scope: "billing/account:42", Partition: 4, Epoch: 9, Acquisition: "a9", Key: "order-1", Worker: "w1"}
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

// Only leasehold's headers and W3C trace context travel from an effect into
// its value. Headers of the server's namespace would change how the server
// takes the batch: Nats-Expected-Stream fails it (error 10060) on every
// attempt, Nats-Msg-Id has a later effect dropped as a duplicate, Nats-TTL
// is refused by a bucket without per-message TTLs.
func TestForeignHeaders(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "foreign", Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	lease := leasehold.Lease{Scope: "orders", Partition: 2, Epoch: 5, Acquisition: "a5", Holder: "w"}
	header := func() map[string][]string {
		return map[string][]string{
			"Nats-Expected-Stream": {"elsewhere"},
			"Nats-Msg-Id":          {"one-id-for-all"},
			"Nats-TTL":             {"1s"},
			"X-Custom":             {"dropped"},
			"traceparent":          {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
			"tracestate":           {"vendor=1"},
			"baggage":              {"user=alice"},
			"Leasehold-Job":        {"17"},
			"leasehold-epoch":      {"999"}, // the stamp says otherwise, and wins
		}
	}
	stream, err := js.Stream(ctx, "KV_foreign")
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"order-1", "order-2"} {
		st := lease.Stamp(key)
		if err := s.Apply(ctx, sink.Effect{Stamp: st, Subject: "orders." + key, Data: []byte(key), Header: header()}); err != nil {
			t.Fatalf("Apply(%s) with foreign headers: %v", key, err)
		}
		m, err := stream.GetLastMsgForSubject(ctx, "$KV.foreign.orders."+key)
		if err != nil {
			t.Fatalf("%s was not written: %v", key, err)
		}
		for k := range m.Header {
			if strings.EqualFold(k, "X-Custom") || strings.EqualFold(k, "Nats-Expected-Stream") || strings.EqualFold(k, "Nats-Msg-Id") || strings.EqualFold(k, "Nats-TTL") {
				t.Errorf("%s: the value carries %s", key, k)
			}
		}
		for _, k := range []string{"traceparent", "tracestate", "baggage", "Leasehold-Job"} {
			if m.Header.Get(k) == "" && len(m.Header[k]) == 0 {
				t.Errorf("%s: the value lost %s: %v", key, k, m.Header)
			}
		}
		e, ok, err := s.Get(ctx, "orders."+key)
		if err != nil || !ok || e.Stamp != st {
			t.Fatalf("Get(%s) = %+v, %v, %v; want the stamp %+v", key, e.Stamp, ok, err, st)
		}
		for k := range e.Header {
			if strings.HasPrefix(strings.ToLower(k), "nats-") {
				t.Errorf("Get(%s) returns the server's header %s", key, k)
			}
		}
	}
}
