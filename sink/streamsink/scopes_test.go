package streamsink_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Two job streams (orders and payments: the same partition numbers and
// idempotency keys, epochs 10^6 apart) and a lock write into one effect
// log consumed by one runner. Every effect is applied once; after its own
// scope's barrier, a zombie of each is refused; nothing is refused because
// of another scope.
func TestScopesShareOneLog(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	refused := &refusals{}
	r := start(t, js, streamsink.Config{Prefix: "shared", Provision: true, Batch: 16, Observer: refused})

	const orders, payments = "orders", "payments"
	lock := leasehold.LockScope("leases", "report:1")
	type applied struct{ scope, key string }
	want, zombies := map[applied]bool{}, map[applied]bool{}
	dropped := map[leasehold.FenceID]uint64{}
	var last uint64
	pub := func(scope string, p leasehold.Partition, e leasehold.Epoch, key string, barrier bool) {
		t.Helper()
		h := nats.Header{}
		leasehold.Stamp{Scope: scope, Partition: p, Epoch: e, Acquisition: fmt.Sprintf("a%d", e), Key: key, Worker: fmt.Sprintf("%s-w%d", scope, e)}.SetHeader(h)
		if barrier {
			h.Set(leasehold.HeaderBarrier, "1")
		}
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "shared.out.x", Header: h, Data: []byte(scope + " " + key)})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	effect := func(scope string, p leasehold.Partition, e leasehold.Epoch, key string) {
		pub(scope, p, e, key, false)
		want[applied{scope, key}] = true
	}
	zombie := func(scope string, p leasehold.Partition, e leasehold.Epoch, key string) {
		pub(scope, p, e, key, false)
		zombies[applied{scope, key}] = true
		dropped[leasehold.FenceID{Scope: scope, Partition: p}]++
	}
	// orders takes over at i == 10, the lock at i == 15, payments at 20.
	const oOld, oNew = 1_000, 2_000
	const pOld, pNew = 1_001_000, 1_002_000
	const lOld, lNew = 500, 600
	for i := range 30 {
		for p := range leasehold.Partition(4) {
			key := fmt.Sprintf("job.%d.%d", p, i)
			if i == 10 {
				pub(orders, p, oNew, leasehold.BarrierKey(orders, p, oNew), true)
			}
			if i == 20 {
				pub(payments, p, pNew, leasehold.BarrierKey(payments, p, pNew), true)
			}
			switch {
			case i < 10:
				effect(orders, p, oOld, key)
			case i < 13:
				zombie(orders, p, oOld, "zombie."+key)
				fallthrough
			default:
				effect(orders, p, oNew, key)
			}
			switch {
			case i < 20:
				effect(payments, p, pOld, key)
			case i < 23:
				zombie(payments, p, pOld, "zombie."+key)
				fallthrough
			default:
				effect(payments, p, pNew, key)
			}
		}
		key := fmt.Sprintf("job.0.%d", i)
		if i == 15 {
			pub(lock, 0, lNew, leasehold.BarrierKey(lock, 0, lNew), true)
		}
		switch {
		case i < 15:
			effect(lock, 0, lOld, key)
		case i < 18:
			zombie(lock, 0, lOld, "zombie."+key)
			fallthrough
		default:
			effect(lock, 0, lNew, key)
		}
	}
	if err := r.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}

	got, err := downstream(ctx, js, "shared-fenced")
	if err != nil {
		t.Fatal(err)
	}
	count := map[applied]int{}
	for _, e := range got {
		count[applied{e.Stamp.Scope, e.Stamp.Key}]++
	}
	for k := range want {
		if count[k] != 1 {
			t.Errorf("effect %s of %s applied %d times, want once", k.key, k.scope, count[k])
		}
		if d, ok := refused.of(k.scope, k.key); ok {
			t.Errorf("effect %s of %s was refused: %v", k.key, k.scope, d.Err)
		}
	}
	for k := range zombies {
		if count[k] != 0 {
			t.Errorf("zombie %s of %s applied %d times", k.key, k.scope, count[k])
		}
		d, ok := refused.of(k.scope, k.key)
		if !ok || d.Outcome != sink.Stale {
			t.Errorf("zombie %s of %s: %+v, want refused as stale", k.key, k.scope, d)
			continue
		}
		// The refusal names the zombie's own scope's fence.
		if !strings.Contains(d.Err.Error(), "scope "+k.scope+" ") || !strings.Contains(d.Holder, k.scope+"-w") {
			t.Errorf("zombie %s of %s refused with %q (holder %q): not its own scope's fence", k.key, k.scope, d.Err, d.Holder)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d effects downstream, want %d", len(got), len(want))
	}
	for _, scope := range []string{orders, payments, lock} {
		for p := range leasehold.Partition(4) {
			id := leasehold.FenceID{Scope: scope, Partition: p}
			if n := r.Dropped(id); n != dropped[id] {
				t.Errorf("Dropped(%s) = %d, want %d", id, n, dropped[id])
			}
		}
	}
	for p := range leasehold.Partition(4) {
		if f := r.Fence(leasehold.FenceID{Scope: orders, Partition: p}); f.Epoch != oNew {
			t.Errorf("orders/%d at %d, want %d", p, f.Epoch, oNew)
		}
		if f := r.Fence(leasehold.FenceID{Scope: payments, Partition: p}); f.Epoch != pNew {
			t.Errorf("payments/%d at %d, want %d", p, f.Epoch, pNew)
		}
	}
	if f := r.Fence(leasehold.FenceID{Scope: lock, Partition: 0}); f.Epoch != lNew || f.Acquisition != fmt.Sprintf("a%d", lNew) {
		t.Errorf("the lock's fence %+v, want epoch %d", f, lNew)
	}
	if n := r.Fences(); n != 9 {
		t.Errorf("the runner keeps %d fences, want 9", n)
	}
}

// A republished effect carries leasehold's headers and W3C trace context,
// and nothing else: no Nats- header of the publisher's (Nats-Expected-Stream
// would fail the republish for ever), no header of other software. The
// downstream message ID is the scope and the key; lower-case stamp headers
// are written back in canonical form.
func TestRepublishHeaders(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	r := start(t, js, streamsink.Config{Prefix: "hdr", Provision: true})
	st := leasehold.Stamp{Scope: "hdr", Partition: 3, Epoch: 4, Acquisition: "a4", Key: leasehold.EffectKey("hdr", 3, 17, 0), Worker: "w4"}
	h := nats.Header{}
	for k, v := range map[string][]string(stampHeaders(st)) {
		h[strings.ToLower(k)] = v
	}
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	h["traceparent"] = []string{traceparent}
	h["tracestate"] = []string{"vendor=1"}
	// A job's one effect, its final: applied at once, its headers kept.
	h["Leasehold-Job"] = []string{"17"}
	h["Leasehold-Attempt"] = []string{"1"}
	h["Leasehold-Effects"] = []string{"1"}
	h["Leasehold-After"] = []string{"0"}
	// The log takes it; the downstream stream would refuse it for ever.
	h["Nats-Expected-Stream"] = []string{"hdr-effects"}
	h["nats-msg-id"] = []string{st.Key + "@4~abc"}
	h["X-Other"] = []string{"not the sink's"}
	ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "hdr.out.a", Header: h, Data: []byte("v")})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.WaitPosition(ctx, ack.Sequence); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, "hdr-fenced")
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.GetLastMsgForSubject(ctx, "hdr.fenced.a")
	if err != nil {
		t.Fatal(err)
	}
	got, err := leasehold.StampFromHeader(m.Header)
	if err != nil || got != st {
		t.Fatalf("downstream stamp %+v, %v; want %+v", got, err, st)
	}
	wantHeaders := map[string]string{
		leasehold.HeaderScope: "hdr", leasehold.HeaderPartition: "3", leasehold.HeaderEpoch: "4",
		leasehold.HeaderAcquisition: "a4", leasehold.HeaderKey: st.Key, leasehold.HeaderWorker: "w4",
		"Leasehold-Job": "17", "Leasehold-Attempt": "1", "Leasehold-Effects": "1", "Leasehold-After": "0", "traceparent": traceparent, "tracestate": "vendor=1",
		jetstream.MsgIDHeader: streamsink.MessageID(st),
	}
	for k, vs := range m.Header {
		want, ok := wantHeaders[k]
		if !ok || len(vs) != 1 || vs[0] != want {
			t.Errorf("downstream header %s: %q, want %q (present: %v)", k, vs, want, ok)
		}
	}
	if len(m.Header) != len(wantHeaders) {
		t.Errorf("downstream headers %v, want exactly %v", m.Header, wantHeaders)
	}
	if id := streamsink.MessageID(st); id != "hdr hdr.3.17.0" {
		t.Errorf("MessageID = %q, want \"hdr hdr.3.17.0\"", id)
	}
}

func stampHeaders(s leasehold.Stamp) nats.Header {
	h := nats.Header{}
	s.SetHeader(h)
	return h
}
