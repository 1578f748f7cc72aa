package coordinator_test

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// Records a client can leave in the buckets that leasehold never writes
// are found, each with what to do, and Repair (Fence, for partitions)
// puts each right; afterwards nothing is found and every partition can be
// acquired.
func TestFindingsAndRepair(t *testing.T) {
	t.Parallel()
	_, b := startBucketWithJobs(t, 8, 5)
	ctx := ctxFor(t, 30*time.Second)
	leases, fences := b.KeyValue(), b.FenceRecords()
	c := newCoord(t, b, "op", 2*time.Second)
	put := func(kv jetstream.KeyValue, key, value string) {
		t.Helper()
		if _, err := kv.Put(ctx, key, []byte(value)); err != nil {
			t.Fatal(err)
		}
	}
	put(leases, "partition.3", "garbage")
	put(leases, "partition.4", `{"holder":"ghost","token":"t","ttl_ms":2000,"acquired":"2026-01-01T00:00:00Z"}`) // no TTL
	put(leases, "member.ghost", `{"holder":"ghost","token":"t","ttl_ms":2000}`)                                  // no TTL
	put(leases, "member.junk", "junk")
	put(fences, "partition.5", `{"epoch":1,"seq":1000,"holder":"forger"}`) // beyond the job stream's 5
	put(fences, "partition.6", `{"epoch":`+maxInt64+`,"seq":2,"holder":"forger"}`)
	put(fences, "partition.7", "{")
	put(leases, "partition.99", "x")
	put(leases, "stray", "x")

	want := map[string]coordinator.FindingKind{
		"partition.3":  coordinator.FindingForeign,
		"partition.4":  coordinator.FindingForeign,
		"member.ghost": coordinator.FindingForeign,
		"member.junk":  coordinator.FindingForeign,
		"partition.5":  coordinator.FindingProgressAhead,
		"partition.6":  coordinator.FindingEpochAhead,
		"partition.7":  coordinator.FindingGarbledFence,
		"stray":        coordinator.FindingUnknownKey,
	}
	st, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := map[string][]coordinator.FindingKind{}
	for _, f := range st.Findings {
		found[f.Key] = append(found[f.Key], f.Kind)
		if f.Problem == "" || f.Fix == "" {
			t.Errorf("finding %v does not say what is wrong and what to do", f)
		}
	}
	for key, kind := range want {
		if !slices.Contains(found[key], kind) {
			t.Errorf("%s: found %v, want %s", key, found[key], kind)
		}
	}
	if !slices.Contains(found["partition.99"], coordinator.FindingOutOfRange) {
		t.Errorf("partition.99: found %v", found["partition.99"])
	}
	if len(st.Members) != 0 {
		t.Errorf("members %v: records without a TTL are not live workers", st.Members)
	}
	for _, p := range st.Partitions {
		if (p.Partition == 3 || p.Partition == 4) && p.Holder != "?" {
			t.Errorf("partition %d shows holder %q", p.Partition, p.Holder)
		}
	}
	// Acquire refuses what it cannot hold; Repair takes care of it.
	for _, p := range []leasehold.Partition{3, 4, 6, 7} {
		if l, err := c.Acquire(ctx, p); err == nil {
			t.Errorf("acquired partition %d over a bad record at %d", p, l.Epoch())
			_ = l.Release(ctx)
		}
	}
	for _, f := range st.Findings {
		res, err := c.Repair(ctx, f)
		switch f.Kind {
		case coordinator.FindingUnknownKey, coordinator.FindingOutOfRange:
			if err == nil {
				t.Errorf("Repair(%v) touched a key leasehold does not use", f)
			}
			continue
		}
		if err != nil {
			t.Fatalf("Repair(%v): %v", f, err)
		}
		t.Logf("%s: %v", f.Key, res.Repaired)
	}
	st, err = b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range st.Findings {
		if f.Kind != coordinator.FindingUnknownKey && f.Kind != coordinator.FindingOutOfRange {
			t.Errorf("still found after the repairs: %v", f)
		}
	}
	if p, _ := b.Progress(ctx, 5); p != 5 {
		t.Errorf("progress of 5 after the repair: %d, want the job stream's last sequence 5", p)
	}
	if p, _ := b.Progress(ctx, 6); p != 2 {
		t.Errorf("progress of 6 after the repair: %d, want 2 kept", p)
	}
	for _, p := range []leasehold.Partition{3, 4, 5, 6, 7} {
		l, err := c.Acquire(ctx, p)
		if err != nil {
			t.Fatalf("partition %d after the repairs: %v", p, err)
		}
		_ = l.Release(ctx)
	}
}

// logRecorder keeps the WARN records a logger receives.
type logRecorder struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *logRecorder) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.recs = append(r.recs, rec.Clone())
	r.mu.Unlock()
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

// about counts the records with message msg whose key attribute is key.
func (r *logRecorder) about(key, msg string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, rec := range r.recs {
		if msg != "" && rec.Message != msg {
			continue
		}
		rec.Attrs(func(a slog.Attr) bool {
			if a.Key == "key" && a.Value.String() == key {
				n++
			}
			return true
		})
	}
	return n
}

// A partition record that does not decode, and one without a TTL, no
// longer keep a partition unheld for ever: the group takes both over once
// they have outlived any lease, and a member record without a TTL gets no
// partitions. Each record is warned about once.
func TestGroupTakesOverForeignRecords(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	ctx := ctxFor(t, 60*time.Second)
	leases := b.KeyValue()
	for key, value := range map[string]string{
		"partition.1":    "garbage",
		"partition.2":    `{"holder":"phantom","token":"t","ttl_ms":1000}`,
		"member.phantom": `{"holder":"phantom","token":"t","ttl_ms":1000}`,
	} {
		if _, err := leases.Put(ctx, key, []byte(value)); err != nil {
			t.Fatal(err)
		}
	}
	rec := &logRecorder{}
	c, err := coordinator.New(b, coordinator.Config{Worker: "w", Partitions: 4, TTL: time.Second, Logger: slog.New(rec)})
	if err != nil {
		t.Fatal(err)
	}
	runGroup(t, ctx, c)
	for len(c.Held()) != 4 {
		select {
		case <-ctx.Done():
			t.Fatalf("the group holds %d of 4 partitions: the foreign records kept the rest", len(c.Held()))
		case <-time.After(50 * time.Millisecond):
		}
	}
	for _, key := range []string{"partition.1", "partition.2"} {
		if n := rec.about(key, ""); n != 1 {
			t.Errorf("%s warned about %d times, want once", key, n)
		}
	}
	if n := rec.about("member.phantom", ""); n != 1 {
		t.Errorf("member.phantom warned about %d times, want once", n)
	}
}
