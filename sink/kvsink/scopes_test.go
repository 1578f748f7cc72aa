package kvsink_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Two job streams with the same partition numbers and the same keys, whose
// epochs are a million apart, and a lock, write into one bucket: every
// effect of each is applied once, a zombie of each is refused by its own
// fence, and nothing is refused because of another scope.
func TestSharedBucket(t *testing.T) {
	t.Parallel()
	onEachTopology(t, testSharedBucket)
}

// holder is one acquisition of one fence.
type holder struct {
	lease leasehold.Lease
	name  string // a prefix for the scope's subjects
}

func (h holder) effect(n int) sink.Effect {
	key := fmt.Sprintf("job-%d-%d", h.lease.Partition, n)
	return sink.Effect{
		Stamp:   h.lease.Stamp(key),
		Subject: h.name + "." + key,
		Data:    []byte(fmt.Sprintf("%s %s by %s", h.lease.Scope, key, h.lease.Holder)),
	}
}

func (h holder) next() holder {
	h.lease.Epoch++
	h.lease.Acquisition += "-next"
	h.lease.Holder += "-next"
	return h
}

func testSharedBucket(t *testing.T, js jetstream.JetStream, replicas int) {
	ctx := ctxFor(t, 2*time.Minute)
	obs := &decisions{}
	s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "shared", Replicas: replicas, Observer: obs, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	var first []holder
	for p := range leasehold.Partition(4) {
		// payments' lease bucket was created later: its epochs are 10^6
		// above orders'.
		first = append(first,
			holder{leasehold.Lease{Scope: "orders", Partition: p, Epoch: 1_000 + leasehold.Epoch(p), Acquisition: fmt.Sprintf("o%d", p), Holder: "orders-w"}, "orders"},
			holder{leasehold.Lease{Scope: "payments", Partition: p, Epoch: 1_001_000 + leasehold.Epoch(p), Acquisition: fmt.Sprintf("p%d", p), Holder: "payments-w"}, "payments"})
	}
	// A lock in orders' namespace, at an epoch between the two streams'.
	first = append(first, holder{leasehold.Lease{Scope: leasehold.LockScope("orders", "account:42"), Partition: 0, Epoch: 500_000, Acquisition: "l0", Holder: "lock-w"}, "lock"})

	batch := func(hs []holder, n int) []sink.Effect {
		var es []sink.Effect
		for _, h := range hs {
			es = append(es, h.effect(n))
		}
		return es
	}
	// The first holders write jobs 0-2, every scope in each batch.
	want := map[[2]string]sink.Effect{}
	for n := range 3 {
		es := batch(first, n)
		if err := s.Apply(ctx, es...); err != nil {
			t.Fatalf("first holders, job %d: %v", n, err)
		}
		for _, e := range es {
			want[[2]string{e.Stamp.Scope, e.Stamp.Key}] = e
		}
	}
	// Every fence is taken over.
	var second []holder
	for _, h := range first {
		n := h.next()
		if err := s.Advance(ctx, n.lease); err != nil {
			t.Fatalf("take-over of %s: %v", n.lease.Fence(), err)
		}
		second = append(second, n)
	}
	// The zombie of each fence writes job 3: refused, by its own fence.
	for _, h := range first {
		z := h.effect(3)
		err := s.Apply(ctx, z)
		var se *leasehold.StaleEpochError
		if !errors.As(err, &se) || se.Scope != h.lease.Scope || se.Partition != h.lease.Partition || se.Max != h.lease.Epoch+1 || se.Holder != h.lease.Holder+"-next" {
			t.Fatalf("zombie of %s: %v, want a stale-epoch error of its own fence, max %d, held by %s-next", h.lease.Fence(), err, h.lease.Epoch+1, h.lease.Holder)
		}
	}
	// The new holders write jobs 3-5 and re-run job 0, which is applied
	// already.
	for n := 3; n < 6; n++ {
		es := batch(second, n)
		if err := s.Apply(ctx, es...); err != nil {
			t.Fatalf("second holders, job %d: %v", n, err)
		}
		for _, e := range es {
			want[[2]string{e.Stamp.Scope, e.Stamp.Key}] = e
		}
	}
	if err := s.Apply(ctx, batch(second, 0)...); err != nil {
		t.Fatalf("re-run of job 0: %v", err)
	}

	got, err := s.Effects(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Errorf("%d effects applied, want %d", len(got), len(want))
	}
	for _, e := range got {
		w, ok := want[[2]string{e.Stamp.Scope, e.Stamp.Key}]
		if !ok || string(e.Data) != string(w.Data) || e.Stamp != w.Stamp {
			t.Errorf("applied %s %s: %q stamped %+v, want %q stamped %+v", e.Stamp.Scope, e.Stamp.Key, e.Data, e.Stamp, w.Data, w.Stamp)
		}
	}
	if n := len(obs.of(sink.Duplicate)); n != len(second) {
		t.Errorf("%d duplicates, want %d (the re-run of job 0)", n, len(second))
	}
	if n := len(obs.of(sink.Stale)) + len(obs.of(sink.SplitBrain)); n != len(first) {
		t.Errorf("%d refusals, want %d (one zombie per fence)", n, len(first))
	}
	for _, h := range second {
		id := h.lease.Fence()
		if n := s.Dropped(id); n != 1 {
			t.Errorf("Dropped(%s) = %d, want 1", id, n)
		}
		f, err := s.Fence(ctx, id)
		if err != nil || f != (leasehold.FenceState{Epoch: h.lease.Epoch, Acquisition: h.lease.Acquisition, Holder: h.lease.Holder}) {
			t.Errorf("Fence(%s) = %+v, %v; want the second holder's", id, f, err)
		}
	}
}

// The longest legal scope, every byte of it escaped, at the highest
// partition: its fence key is the longest the sink writes, and the server
// takes it, keeps it and reads it back.
func TestLongestScope(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	cfg := kvsink.Config{Bucket: "longest", Logger: quiet()}
	s, err := kvsink.New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	scope := strings.Repeat(".=:*", leasehold.MaxScopeLen/4)
	if err := leasehold.ValidateScope(scope); err != nil || len(scope) != leasehold.MaxScopeLen {
		t.Fatalf("scope of %d bytes: %v", len(scope), err)
	}
	a := leasehold.Lease{Scope: scope, Partition: leasehold.MaxPartitions - 1, Epoch: 7, Acquisition: "a7", Holder: "a"}
	b := leasehold.Lease{Scope: scope, Partition: a.Partition, Epoch: 8, Acquisition: "a8", Holder: "b"}
	if err := s.Apply(ctx, sink.Effect{Stamp: a.Stamp("k1"), Subject: "long.k1", Data: []byte("a")}); err != nil {
		t.Fatal(err)
	}
	if err := s.Advance(ctx, b); err != nil {
		t.Fatal(err)
	}
	if err := s.Apply(ctx, sink.Effect{Stamp: a.Stamp("k2"), Subject: "long.k2", Data: []byte("a")}); !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("zombie under the longest scope: %v, want ErrStaleEpoch", err)
	}
	// Another instance reads the fence from the server.
	other, err := kvsink.New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if f, err := other.Fence(ctx, b.Fence()); err != nil || f.Epoch != 8 || f.Acquisition != "a8" || f.Holder != "b" {
		t.Fatalf("Fence = %+v, %v; want epoch 8 of a8, held by b", f, err)
	}
	keys, err := s.KeyValue().ListKeysFiltered(ctx, "_leasehold.fence.>")
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for k := range keys.Keys() {
		found = found || len(k) == kvsink.MaxFenceKeyLen
	}
	if !found {
		t.Fatalf("no fence key of %d bytes in the bucket", kvsink.MaxFenceKeyLen)
	}
	if e, ok, err := other.Get(ctx, "long.k1"); err != nil || !ok || e.Stamp.Scope != scope {
		t.Fatalf("Get = %+v, %v, %v; want the effect stamped with the longest scope", e, ok, err)
	}
}
