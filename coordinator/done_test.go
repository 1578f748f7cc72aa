package coordinator_test

import (
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// A commit carries the jobs finished beyond the watermark in the same
// compare-and-set: the record keeps them (above the watermark, ascending,
// at most MaxDone: the lowest), Committed and Includes read them, and a
// successor's lease resumes with them. A record a release before wrote, or
// rewrote (it drops the field it does not know), has none, and reads as the
// watermark alone.
func TestCommitDone(t *testing.T) {
	t.Parallel()
	_, b := startBucketWithJobs(t, 4, 40)
	ctx := ctxFor(t, 30*time.Second)
	p0 := leasehold.FenceID{Scope: b.Scope(), Partition: 0}

	a := newCoord(t, b, "a", 5*time.Second)
	la, err := a.Acquire(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Unordered, with a duplicate and one at the watermark: the record
	// keeps what is above it, once each, ascending.
	if err := la.Commit(ctx, 5, 9, 7, 5, 9, 12); err != nil {
		t.Fatal(err)
	}
	got, err := b.Committed(ctx, p0)
	if err != nil || got.Seq != 5 || !slices.Equal(got.Done, []uint64{7, 9, 12}) {
		t.Fatalf("after Commit(5, done 9 7 5 9 12): %+v, %v; want seq 5, done [7 9 12]", got, err)
	}
	for job, want := range map[uint64]bool{0: false, 1: true, 5: true, 6: false, 7: true, 8: false, 9: true, 12: true, 13: false} {
		if got.Includes(job) != want {
			t.Errorf("Includes(%d) = %v, want %v", job, !want, want)
		}
	}
	if lc := la.Committed(); lc.Seq != 5 || !slices.Equal(lc.Done, got.Done) || lc.Epoch != la.Epoch() {
		t.Errorf("the lease says it committed %+v, the record %+v", lc, got)
	}
	// The same progress again writes nothing; progress never goes back.
	rev := revisionOf(t, b, "partition.0")
	if err := la.Commit(ctx, 5, 7, 9, 12); err != nil {
		t.Fatal(err)
	}
	if err := la.Commit(ctx, 4, 6); err != nil {
		t.Fatal(err)
	}
	if r := revisionOf(t, b, "partition.0"); r != rev {
		t.Errorf("a commit of the same progress, or of less, rewrote the record (revision %d, then %d)", rev, r)
	}
	// The watermark moves past some: they leave the set.
	if err := la.Commit(ctx, 9, 12, 20); err != nil {
		t.Fatal(err)
	}
	// More than MaxDone: the lowest are kept.
	many := make([]uint64, 0, coordinator.MaxDone+10)
	for i := range coordinator.MaxDone + 10 {
		many = append(many, 100+2*uint64(i))
	}
	if err := la.Commit(ctx, 10, many...); err != nil {
		t.Fatal(err)
	}
	got, err = b.Committed(ctx, p0)
	if err != nil || got.Seq != 10 || len(got.Done) != coordinator.MaxDone || got.Done[0] != 100 || got.Done[len(got.Done)-1] != many[coordinator.MaxDone-1] {
		t.Fatalf("after a commit of %d done jobs: seq %d, %d done (%v...), %v; want the lowest %d", len(many), got.Seq, len(got.Done), got.Done[:min(3, len(got.Done))], err, coordinator.MaxDone)
	}
	if err := la.Commit(ctx, 10, 11, 14); err != nil {
		t.Fatal(err)
	}
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A successor resumes with the done set; the record it fenced keeps it.
	c := newCoord(t, b, "c", 5*time.Second)
	lc := acquireEventually(t, c, 0, 20*time.Second)
	defer lc.Release(ctx)
	if got := lc.Committed(); got.Seq != 10 || !slices.Equal(got.Done, []uint64{11, 14}) {
		t.Fatalf("the successor resumes at %+v, want seq 10 and done [11 14]", got)
	}
	got, err = b.Committed(ctx, p0)
	if err != nil || got.Epoch != lc.Epoch() || !slices.Equal(got.Done, []uint64{11, 14}) {
		t.Fatalf("after the successor fenced the record: %+v, %v", got, err)
	}

	// A release before reads the record (it ignores the field), and when it
	// rewrites it, the field is gone: the record reads as its watermark.
	e, err := b.FenceRecords().Get(ctx, "partition.0")
	if err != nil {
		t.Fatal(err)
	}
	var old struct {
		Epoch        uint64   `json:"epoch"`
		Acquisition  string   `json:"acquisition,omitempty"`
		Seq          uint64   `json:"seq,omitempty"`
		Holder       string   `json:"holder"`
		Recent       []uint64 `json:"recent,omitempty"`
		Acquisitions []string `json:"acquisitions,omitempty"`
		Forgotten    uint64   `json:"forgotten,omitempty"`
	}
	if err := json.Unmarshal(e.Value(), &old); err != nil || old.Seq != 10 || old.Epoch != uint64(lc.Epoch()) {
		t.Fatalf("the record as a release before reads it: %+v, %v", old, err)
	}
	old.Seq = 11
	value, _ := json.Marshal(old)
	if _, err := b.FenceRecords().Update(ctx, "partition.0", value, e.Revision()); err != nil {
		t.Fatal(err)
	}
	got, err = b.Committed(ctx, p0)
	if err != nil || got.Seq != 11 || got.Done != nil || got.Includes(14) {
		t.Fatalf("a record without done: %+v, %v; want seq 11 and nothing done beyond it", got, err)
	}
}

func revisionOf(t *testing.T, b *coordinator.Bucket, key string) uint64 {
	t.Helper()
	e, err := b.FenceRecords().Get(ctxFor(t, 10*time.Second), key)
	if err != nil {
		t.Fatal(err)
	}
	return e.Revision()
}
