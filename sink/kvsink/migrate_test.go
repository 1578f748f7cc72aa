package kvsink_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// legacyBucket is a bucket as the sink wrote it before fence scopes: a
// fence per partition, _leasehold.fence.<p> holding {"epoch", "holder"};
// a dedupe key per applied key, _leasehold.key.<hex sha256 of the key>
// holding the key; and values stamped with partition, epoch, key and
// worker only.
type legacyBucket struct {
	t      *testing.T
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	bucket string
}

func newLegacyBucket(ctx context.Context, t *testing.T, js jetstream.JetStream, bucket string, replicas int) *legacyBucket {
	t.Helper()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1, Storage: jetstream.FileStorage, Replicas: replicas})
	if err != nil {
		t.Fatal(err)
	}
	str, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	sc := str.CachedInfo().Config
	sc.AllowAtomicPublish = true
	if _, err := js.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
	return &legacyBucket{t: t, js: js, kv: kv, bucket: bucket}
}

// oldFence is the record of before, as the old code declared it.
type oldFence struct {
	Epoch  leasehold.Epoch `json:"epoch"`
	Holder string          `json:"holder,omitempty"`
}

func (l *legacyBucket) fence(ctx context.Context, p leasehold.Partition, e leasehold.Epoch, holder string) {
	l.t.Helper()
	body, _ := json.Marshal(oldFence{Epoch: e, Holder: holder})
	if _, err := l.kv.Put(ctx, "_leasehold.fence."+p.String(), body); err != nil {
		l.t.Fatal(err)
	}
}

func (l *legacyBucket) applied(ctx context.Context, p leasehold.Partition, e leasehold.Epoch, key, subject, data string) {
	l.t.Helper()
	sum := sha256.Sum256([]byte(key))
	if _, err := l.kv.Put(ctx, "_leasehold.key."+hex.EncodeToString(sum[:]), []byte(key)); err != nil {
		l.t.Fatal(err)
	}
	m := nats.NewMsg("$KV." + l.bucket + "." + subject)
	m.Data = []byte(data)
	m.Header.Set("Leasehold-Partition", p.String())
	m.Header.Set("Leasehold-Epoch", e.String())
	m.Header.Set("Leasehold-Key", key)
	m.Header.Set("Leasehold-Worker", "old-w")
	if _, err := l.js.PublishMsg(ctx, m); err != nil {
		l.t.Fatal(err)
	}
}

// wantMoved checks that partition p's legacy fence key holds the moved
// text, which a sink built before fence scopes, reading it through the
// stream leader and decoding it as JSON, fails on.
func (l *legacyBucket) wantMoved(ctx context.Context, p leasehold.Partition) {
	l.t.Helper()
	m, err := leader.NewReader(l.js, "KV_"+l.bucket).Last(ctx, "$KV."+l.bucket+"._leasehold.fence."+p.String())
	if err != nil || m == nil {
		l.t.Fatalf("read partition %d's fence of before: %v, %v", p, m, err)
	}
	var f oldFence
	if err := json.Unmarshal(m.Data, &f); err == nil || !strings.HasPrefix(string(m.Data), "moved to _leasehold.fence.") {
		l.t.Fatalf("partition %d's fence of before holds %q, which a sink of before reads as %+v (%v)", p, m.Data, f, err)
	}
}

func TestLegacyBucketRefused(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, time.Minute)
	fences := newLegacyBucket(ctx, t, js, "old-fences", 1)
	fences.fence(ctx, 3, 7, "old-w")
	keys := newLegacyBucket(ctx, t, js, "old-keys", 1)
	keys.applied(ctx, 3, 7, "orders.3.1.0", "orders.1", "paid")
	for _, bucket := range []string{"old-fences", "old-keys"} {
		_, err := kvsink.New(ctx, js, kvsink.Config{Bucket: bucket, Logger: quiet()})
		if !errors.Is(err, kvsink.ErrLegacyRecords) || !strings.Contains(err.Error(), "LegacyScope") {
			t.Fatalf("New on %s without LegacyScope = %v, want ErrLegacyRecords saying to set LegacyScope", bucket, err)
		}
	}
	// A bucket whose records of before were deleted is no longer refused.
	if err := fences.kv.Delete(ctx, "_leasehold.fence.3"); err != nil {
		t.Fatal(err)
	}
	if _, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "old-fences", Logger: quiet()}); err != nil {
		t.Fatalf("New on a bucket whose legacy fence was deleted: %v", err)
	}
}

func TestLegacyBucketAdopted(t *testing.T) {
	t.Parallel()
	onEachTopology(t, testLegacyBucketAdopted)
}

func testLegacyBucketAdopted(t *testing.T, js jetstream.JetStream, replicas int) {
	ctx := ctxFor(t, time.Minute)
	old := newLegacyBucket(ctx, t, js, "old", replicas)
	old.fence(ctx, 3, 7, "old-w")
	old.applied(ctx, 3, 7, "orders.3.1.0", "orders.1", "paid")
	old.fence(ctx, 5, 4, "old-w")
	old.fence(ctx, 6, 3, "old-w")

	obs := &decisions{}
	cfg := kvsink.Config{Bucket: "old", Replicas: replicas, LegacyScope: "orders", Observer: obs, Logger: quiet()}
	s, err := kvsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	orders := func(p leasehold.Partition) leasehold.FenceID { return leasehold.FenceID{Scope: "orders", Partition: p} }
	if f, err := s.Fence(ctx, orders(3)); err != nil || f != (leasehold.FenceState{Epoch: 7, Holder: "old-w"}) {
		t.Fatalf("Fence(orders/3) = %+v, %v; want the record of before", f, err)
	}
	if f, err := s.Fence(ctx, leasehold.FenceID{Scope: "payments", Partition: 3}); err != nil || f.Epoch != 0 {
		t.Fatalf("Fence(payments/3) = %+v, %v; the record of before is orders'", f, err)
	}
	e, ok, err := s.Get(ctx, "orders.1")
	if err != nil || !ok || e.Stamp != (leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 7, Key: "orders.3.1.0", Worker: "old-w"}) {
		t.Fatalf("Get(orders.1) = %+v, %v, %v; want the value of before, in scope orders", e.Stamp, ok, err)
	}

	w8 := leasehold.Lease{Scope: "orders", Partition: 3, Epoch: 8, Acquisition: "a8", Holder: "w8"}
	apply := func(st leasehold.Stamp, subject, data string) error {
		return s.Apply(ctx, sink.Effect{Stamp: st, Subject: subject, Data: []byte(data)})
	}
	// A zombie below the record of before is refused by it.
	zombie := leasehold.Lease{Scope: "orders", Partition: 3, Epoch: 6, Acquisition: "a6", Holder: "w6"}
	var se *leasehold.StaleEpochError
	if err := apply(zombie.Stamp("orders.3.9.0"), "orders.9", "zombie"); !errors.As(err, &se) || se.Max != 7 || se.Holder != "old-w" {
		t.Fatalf("zombie at 6 under the record of before at 7: %v", err)
	}
	// The key applied before is applied for orders, in one batch with a
	// new one.
	if err := s.Apply(ctx,
		sink.Effect{Stamp: w8.Stamp("orders.3.1.0"), Subject: "orders.1", Data: []byte("again")},
		sink.Effect{Stamp: w8.Stamp("orders.3.2.0"), Subject: "orders.2", Data: []byte("new")},
	); err != nil {
		t.Fatal(err)
	}
	if e, _, _ := s.Get(ctx, "orders.1"); string(e.Data) != "paid" {
		t.Fatalf("the key applied before was applied again: orders.1 holds %q", e.Data)
	}
	if n := len(obs.of(sink.Duplicate)); n != 1 {
		t.Fatalf("%d duplicates, want 1", n)
	}
	// In another scope it is another effect.
	pay := leasehold.Lease{Scope: "payments", Partition: 3, Epoch: 2, Acquisition: "p2", Holder: "pw"}
	if err := apply(pay.Stamp("orders.3.1.0"), "payments.1", "paid too"); err != nil {
		t.Fatal(err)
	}
	if e, _, _ := s.Get(ctx, "payments.1"); string(e.Data) != "paid too" {
		t.Fatalf("payments' effect with the key orders applied before: %q", e.Data)
	}
	if f, err := s.Fence(ctx, orders(3)); err != nil || f != (leasehold.FenceState{Epoch: 8, Acquisition: "a8", Holder: "w8"}) {
		t.Fatalf("Fence(orders/3) = %+v, %v; want w8's", f, err)
	}
	// The record of before moved; a sink built before fence scopes cannot
	// read it and stops rather than fence against it.
	old.wantMoved(ctx, 3)

	// A sink of before raises partition 5 after this one read it: the move
	// fails its compare-and-set, and this sink decides on the new record.
	if f, err := s.Fence(ctx, orders(5)); err != nil || f.Epoch != 4 {
		t.Fatalf("Fence(orders/5) = %+v, %v", f, err)
	}
	old.fence(ctx, 5, 9, "old-w2")
	w8.Partition = 5
	if err := apply(w8.Stamp("orders.5.1.0"), "orders.5", "late"); !errors.As(err, &se) || se.Max != 9 || se.Holder != "old-w2" {
		t.Fatalf("write at 8 after a sink of before raised the record to 9: %v", err)
	}

	// Advance moves the record too.
	w4 := leasehold.Lease{Scope: "orders", Partition: 6, Epoch: 4, Acquisition: "a4", Holder: "w4"}
	if err := s.Advance(ctx, w4); err != nil {
		t.Fatal(err)
	}
	w4.Epoch, w4.Acquisition = 2, "a2"
	if err := s.Advance(ctx, w4); !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("Advance below the moved record: %v, want ErrStaleEpoch", err)
	}
	old.wantMoved(ctx, 6)

	// A new instance reads the moved fences from their scoped keys, and
	// the values of before with their scope.
	s2, err := kvsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[leasehold.Partition]leasehold.FenceState{
		3: {Epoch: 8, Acquisition: "a8", Holder: "w8"},
		5: {Epoch: 9, Holder: "old-w2"},
		6: {Epoch: 4, Acquisition: "a4", Holder: "w4"},
	} {
		if f, err := s2.Fence(ctx, orders(p)); err != nil || f != want {
			t.Errorf("after reopen, Fence(orders/%d) = %+v, %v; want %+v", p, f, err, want)
		}
	}
	es, err := s2.Effects(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range es {
		got[e.Stamp.Scope+" "+e.Stamp.Key] = string(e.Data)
	}
	if len(got) != 3 || got["orders orders.3.1.0"] != "paid" || got["orders orders.3.2.0"] != "new" || got["payments orders.3.1.0"] != "paid too" {
		t.Fatalf("Effects = %v", got)
	}
	// The records of before are still there: LegacyScope stays needed.
	if _, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "old", Logger: quiet()}); !errors.Is(err, kvsink.ErrLegacyRecords) {
		t.Fatalf("New without LegacyScope after the move: %v, want ErrLegacyRecords", err)
	}

	// A moved fence whose scoped key is deleted is not read from the
	// record of before: writes stay refused, saying why.
	if err := old.kv.Delete(ctx, "_leasehold.fence.orders.3"); err != nil {
		t.Fatal(err)
	}
	w8.Partition = 3
	if err := s2.Apply(ctx, sink.Effect{Stamp: w8.Stamp("orders.3.3.0"), Subject: "orders.3", Data: []byte("x")}); err == nil || !strings.Contains(err.Error(), "moved there") {
		t.Fatalf("write to a fence whose moved record was deleted: %v, want an error saying so", err)
	}
}
