package coordinator_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// oldBucket makes a lease bucket the way leasehold did before fence
// records had a bucket of their own (git show d22ff65:coordinator/):
// the same stream, metadata without a scope, and progress.<p> records of
// {"epoch","seq","holder"} beside the leases.
func oldBucket(t *testing.T, js jetstream.JetStream, name string, progress map[leasehold.Partition][2]uint64) map[leasehold.Partition]uint64 {
	t.Helper()
	ctx := ctxFor(t, 20*time.Second)
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:                   "KV_" + name,
		Subjects:               []string{"$KV." + name + ".>"},
		MaxMsgsPerSubject:      1,
		Storage:                jetstream.FileStorage,
		AllowRollup:            true,
		DenyDelete:             true,
		AllowDirect:            true,
		Discard:                jetstream.DiscardNew,
		AllowMsgTTL:            true,
		SubjectDeleteMarkerTTL: time.Second,
		FirstSeq:               uint64(time.Now().UnixMicro()),
		Metadata:               map[string]string{"leasehold": "lease-bucket"},
	})
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	revs := map[leasehold.Partition]uint64{}
	for p, es := range progress {
		// An acquisition's revision is the epoch the record carries.
		epoch, err := kv.Put(ctx, fmt.Sprintf("partition.%d", p), []byte(`{"holder":"old","token":"t"}`))
		if err != nil {
			t.Fatal(err)
		}
		if err := kv.Purge(ctx, fmt.Sprintf("partition.%d", p)); err != nil {
			t.Fatal(err)
		}
		if es[0] != 0 {
			epoch = es[0]
		}
		rec, _ := json.Marshal(map[string]any{"epoch": epoch, "seq": es[1], "holder": "old-worker"})
		if revs[p], err = kv.Put(ctx, fmt.Sprintf("progress.%d", p), rec); err != nil {
			t.Fatal(err)
		}
	}
	return revs
}

// A lease bucket of an earlier leasehold is upgraded in place: Provision,
// run twice at once, moves every progress record into the fence-record
// bucket, and leaves in its place a value the earlier code fails to read,
// so that an earlier worker's commit fails loudly. Progress carries over,
// and the next epochs are above the moved ones.
func TestMigrationMovesProgressRecords(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	want := map[leasehold.Partition][2]uint64{0: {0, 17}, 1: {0, 0}, 5: {0, 123456}}
	revs := oldBucket(t, js, "orders-leases", want)
	old, _ := js.KeyValue(ctx, "orders-leases")
	oldEpoch := map[leasehold.Partition]uint64{}
	for p := range want {
		e, _ := old.Get(ctx, fmt.Sprintf("progress.%d", p))
		var r struct{ Epoch uint64 }
		_ = json.Unmarshal(e.Value(), &r)
		oldEpoch[p] = r.Epoch
	}
	if _, err := coordinator.OpenBucket(ctx, js, "orders-leases"); !errors.Is(err, coordinator.ErrBucketConfig) {
		t.Fatalf("OpenBucket before the upgrade: %v, want a refusal saying to run init", err)
	}

	// Two upgrades at once, over two connections.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	buckets := make([]*coordinator.Bucket, 2)
	for i := range 2 {
		js := srv.JetStream(t)
		wg.Add(1)
		go func() {
			defer wg.Done()
			buckets[i], errs[i] = coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases"})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Provision %d: %v", i, err)
		}
	}
	b := buckets[0]
	if b.Scope() != "orders" || b.FenceBucket() != "orders-leases-fences" {
		t.Fatalf("upgraded bucket: scope %q, fences %q", b.Scope(), b.FenceBucket())
	}
	for p, es := range want {
		if got, err := b.Progress(ctx, p); err != nil || got != es[1] {
			t.Errorf("partition %d: moved progress %d, %v; want %d", p, got, err, es[1])
		}
		if got, err := b.FencedEpoch(ctx, p); err != nil || uint64(got) != oldEpoch[p] {
			t.Errorf("partition %d: moved epoch %d, %v; want %d", p, got, err, oldEpoch[p])
		}
		// An earlier worker commits with a compare-and-set on the
		// revision it last wrote: refused.
		rec, _ := json.Marshal(map[string]any{"epoch": oldEpoch[p], "seq": es[1] + 1, "holder": "old-worker"})
		if _, err := old.Update(ctx, fmt.Sprintf("progress.%d", p), rec, revs[p]); err == nil {
			t.Errorf("partition %d: an earlier worker's commit on the moved record was accepted", p)
		}
		// An earlier worker acquiring reads the replacement: not JSON.
		e, err := old.Get(ctx, fmt.Sprintf("progress.%d", p))
		if err != nil {
			t.Fatal(err)
		}
		var r struct{ Epoch, Seq uint64 }
		if json.Unmarshal(e.Value(), &r) == nil || !strings.Contains(string(e.Value()), "upgrade") {
			t.Errorf("partition %d: the lease bucket still holds %q, which an earlier worker would read", p, e.Value())
		}
	}
	c := newCoord(t, b, "new", 2*time.Second)
	for p, es := range want {
		l, err := c.Acquire(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		if l.Progress() != es[1] || uint64(l.Epoch()) <= oldEpoch[p] {
			t.Errorf("partition %d: acquired at %d resuming after %d; want above %d resuming after %d", p, l.Epoch(), l.Progress(), oldEpoch[p], es[1])
		}
		_ = l.Release(ctx)
	}
	if f, err := b.Findings(ctx); err != nil || len(f) != 0 {
		t.Fatalf("findings after the upgrade: %v, %v", f, err)
	}
	// Provision again: nothing left to move, nothing changes.
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases"}); err != nil {
		t.Fatal(err)
	}
	if got, _ := b.Progress(ctx, 5); got != 123456 {
		t.Fatalf("progress of 5 after a second upgrade: %d", got)
	}
}

// A progress record an earlier worker writes after the move is a finding,
// and Repair moves it too, when it is newer than the fence record.
func TestMigrationOfALateLegacyRecord(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	oldBucket(t, js, "orders-leases", map[leasehold.Partition][2]uint64{2: {0, 5}})
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases"})
	if err != nil {
		t.Fatal(err)
	}
	epoch, _ := b.FencedEpoch(ctx, 2)
	rec, _ := json.Marshal(map[string]any{"epoch": epoch + 1, "seq": 9, "holder": "old-worker"})
	if _, err := b.KeyValue().Put(ctx, "progress.3", rec); err != nil {
		t.Fatal(err)
	}
	fs, err := b.Findings(ctx)
	if err != nil || len(fs) != 1 || fs[0].Kind != coordinator.FindingLegacyProgress || fs[0].Key != "progress.3" {
		t.Fatalf("findings: %v, %v", fs, err)
	}
	if _, err := newCoord(t, b, "op", 2*time.Second).Repair(ctx, fs[0]); err != nil {
		t.Fatal(err)
	}
	if got, _ := b.Progress(ctx, 3); got != 9 {
		t.Fatalf("progress of 3 after the repair: %d", got)
	}
	if fs, err := b.Findings(ctx); err != nil || len(fs) != 0 {
		t.Fatalf("findings after the repair: %v, %v", fs, err)
	}
}
