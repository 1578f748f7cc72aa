package coordinator_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// wantNotIssued fails unless err is a *NotIssuedError for reason r.
func wantNotIssued(t *testing.T, what string, err error, r coordinator.NotIssuedReason) *coordinator.NotIssuedError {
	t.Helper()
	var ni *coordinator.NotIssuedError
	if !errors.As(err, &ni) || !errors.Is(err, coordinator.ErrNotIssued) || !ni.Unverified() || ni.Reason != r {
		t.Fatalf("%s = %v, want a NotIssuedError for %v", what, err, r)
	}
	return ni
}

// VerifyAcquisition admits an epoch only with the acquisition that fenced
// the fence's record, current or remembered, and says why it refuses the
// rest: the holder's epoch with a forged token, a lock's epoch presented
// on a partition and the reverse (issued between the fence's own), an
// epoch above every revision of the key, on one node and on the cluster.
func TestVerifyAcquisition(t *testing.T) {
	t.Parallel()
	onEachTopology(t, func(t *testing.T, js jetstream.JetStream, replicas int) {
		b := provisionWithJobs(t, js, replicas, 8, 0)
		ctx := ctxFor(t, 30*time.Second)
		c := newCoord(t, b, "a", 5*time.Second)

		la, err := c.Acquire(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		p0 := la.Info().Fence()
		if err := verify(ctx, b, p0, la.Epoch(), la.Info().Acquisition); err != nil {
			t.Fatalf("the holder's own epoch and acquisition: %v", err)
		}
		ni := wantNotIssued(t, "the holder's epoch with a forged acquisition", verify(ctx, b, p0, la.Epoch(), "forged"), coordinator.ReasonOtherAcquisition)
		if ni.Other != la.Info().Acquisition || !strings.Contains(ni.Error(), "forged") {
			t.Fatalf("refusal %q does not name the recorded acquisition", ni)
		}
		l1, err := c.TryLock(ctx, "report")
		if err != nil {
			t.Fatal(err)
		}
		lock1 := l1.Info()
		if err := l1.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		// B's acquiring write stays in the lease bucket while its lease
		// is not renewed.
		lb, err := newCoord(t, b, "b", time.Minute).Acquire(ctx, 0, coordinator.ManualRenew())
		if err != nil {
			t.Fatal(err)
		}
		defer lb.Release(ctx)
		l2, err := c.TryLock(ctx, "report")
		if err != nil {
			t.Fatal(err)
		}
		defer l2.Release(ctx)
		if !(la.Epoch() < lock1.Epoch && lock1.Epoch < lb.Epoch() && lb.Epoch() < l2.Epoch()) {
			t.Fatalf("epochs %d %d %d %d out of order", la.Epoch(), lock1.Epoch, lb.Epoch(), l2.Epoch())
		}
		wantNotIssued(t, "the lock's epoch on partition 0", verify(ctx, b, p0, lock1.Epoch, lock1.Acquisition), coordinator.ReasonNotFenced)
		ni = wantNotIssued(t, "partition 0's epoch on the lock", verify(ctx, b, lock1.Fence(), lb.Epoch(), lb.Info().Acquisition), coordinator.ReasonOtherWrite)
		if !strings.Contains(ni.Error(), "partition.0") {
			t.Fatalf("refusal %q does not name the key epoch %d was written to", ni, lb.Epoch())
		}
		// The former holders stay verifiable.
		for _, l := range []leasehold.Lease{la.Info(), lock1, lb.Info(), l2.Info()} {
			if err := verify(ctx, b, l.Fence(), l.Epoch, l.Acquisition); err != nil {
				t.Fatalf("acquisition %s of %s at %d: %v", l.Acquisition, l.Fence(), l.Epoch, err)
			}
		}
		ni = wantNotIssued(t, "an epoch above the live lease", verify(ctx, b, p0, lb.Epoch()+1, "x"), coordinator.ReasonAboveIssued)
		if ni.Bound != lb.Epoch() {
			t.Fatalf("bound %d, want the live lease's epoch %d", ni.Bound, lb.Epoch())
		}
		var ue *coordinator.UnknownFenceError
		if err := verify(ctx, b, leasehold.FenceID{Scope: b.Scope(), Partition: 8}, lb.Epoch(), "x"); !errors.As(err, &ue) {
			t.Fatalf("a partition outside the job stream: %v, want an UnknownFenceError", err)
		}
	})
}

// Where the lease bucket still holds its write at the revision (a
// session-held partition's record stays until it is released), that write
// must be an acquisition of the fence itself: a fence record that a
// client rewrote to claim another partition's acquisition verifies
// nothing, although the epoch is below its own holder's.
func TestVerifyAcquisitionReadsTheLeaseWrite(t *testing.T) {
	t.Parallel()
	_, b := startBucketWithJobs(t, 8, 0)
	ctx := ctxFor(t, 30*time.Second)
	c := newCoord(t, b, "a", 5*time.Second)
	sess, err := c.RegisterSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sess.KeepRenewing()
	defer sess.Release(ctx)
	held, err := c.AcquireInSession(ctx, 1, sess)
	if err != nil {
		t.Fatal(err)
	}
	other, err := c.Acquire(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Release(ctx)
	h, o := held.Info(), other.Info()
	if err := verify(ctx, b, h.Fence(), h.Epoch, h.Acquisition); err != nil {
		t.Fatalf("a session-held partition's own acquisition: %v", err)
	}
	forged, _ := json.Marshal(map[string]any{
		"epoch": uint64(o.Epoch), "acquisition": o.Acquisition, "holder": "a",
		"recent": []uint64{uint64(h.Epoch), uint64(o.Epoch)}, "acquisitions": []string{h.Acquisition, o.Acquisition},
	})
	if _, err := b.FenceRecords().Put(ctx, "partition.2", forged); err != nil {
		t.Fatal(err)
	}
	ni := wantNotIssued(t, "partition 1's acquisition claimed by partition 2's record", verify(ctx, b, o.Fence(), h.Epoch, h.Acquisition), coordinator.ReasonOtherWrite)
	if !strings.Contains(ni.Error(), "partition.1") {
		t.Fatalf("refusal %q does not name the key the revision was written to", ni)
	}
	if err := verify(ctx, b, o.Fence(), o.Epoch, o.Acquisition); err != nil {
		t.Fatalf("partition 2's own acquisition: %v", err)
	}
}

// A fence record remembers the last FenceHistory acquisitions: the oldest
// of them verifies, the one before is refused as forgotten, distinctly.
func TestVerifyAcquisitionForgets(t *testing.T) {
	t.Parallel()
	_, b := startBucketWithJobs(t, 8, 0)
	ctx := ctxFor(t, 60*time.Second)
	c := newCoord(t, b, "a", 5*time.Second)
	var infos []leasehold.Lease
	for range coordinator.FenceHistory + 1 {
		l, err := c.Acquire(ctx, 3)
		if err != nil {
			t.Fatal(err)
		}
		infos = append(infos, l.Info())
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	first, oldest := infos[0], infos[1]
	if err := verify(ctx, b, oldest.Fence(), oldest.Epoch, oldest.Acquisition); err != nil {
		t.Fatalf("the oldest acquisition remembered: %v", err)
	}
	ni := wantNotIssued(t, "an acquisition the record forgot", verify(ctx, b, first.Fence(), first.Epoch, first.Acquisition), coordinator.ReasonForgotten)
	if !ni.Forgotten() || ni.Oldest != oldest.Epoch || !strings.Contains(ni.Error(), fmt.Sprint(coordinator.FenceHistory)) {
		t.Fatalf("forgotten refusal %+v (%q)", ni, ni)
	}
}

// A fence record of the release before keeps epochs only: those verify by
// epoch alone, its current acquisition by token; fenced again by this
// release, it keeps them so, and adds the new acquisition with its token.
func TestVerifyAcquisitionPreviousRelease(t *testing.T) {
	t.Parallel()
	_, b := startBucketWithJobs(t, 8, 0)
	ctx := ctxFor(t, 30*time.Second)
	c := newCoord(t, b, "a", 5*time.Second)
	l0, err := c.Acquire(ctx, 4)
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l1, err := c.Acquire(ctx, 4)
	if err != nil {
		t.Fatal(err)
	}
	e0, i1 := l0.Epoch(), l1.Info()
	entry, err := b.FenceRecords().Get(ctx, "partition.4")
	if err != nil {
		t.Fatal(err)
	}
	prev := fmt.Sprintf(`{"epoch":%d,"acquisition":%q,"holder":"a","recent":[%d,%d]}`, i1.Epoch, i1.Acquisition, e0, i1.Epoch)
	if _, err := b.FenceRecords().Update(ctx, "partition.4", []byte(prev), entry.Revision()); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		if err := verify(ctx, b, i1.Fence(), e0, "any"); err != nil {
			t.Fatalf("%s: an epoch the previous release recorded: %v", when, err)
		}
		if err := verify(ctx, b, i1.Fence(), i1.Epoch, i1.Acquisition); err != nil {
			t.Fatalf("%s: the record's own acquisition: %v", when, err)
		}
		wantNotIssued(t, when+": the record's own epoch with a forged acquisition", verify(ctx, b, i1.Fence(), i1.Epoch, "forged"), coordinator.ReasonOtherAcquisition)
	}
	check("previous format")
	if err := l1.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := c.Acquire(ctx, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	check("fenced again")
	entry, err = b.FenceRecords().Get(ctx, "partition.4")
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		Recent       []uint64 `json:"recent"`
		Acquisitions []string `json:"acquisitions"`
	}
	if err := json.Unmarshal(entry.Value(), &rec); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%v %v", []uint64{uint64(e0), uint64(i1.Epoch), uint64(l2.Epoch())}, []string{"", i1.Acquisition, l2.Info().Acquisition})
	if got := fmt.Sprintf("%v %v", rec.Recent, rec.Acquisitions); got != want {
		t.Fatalf("record fenced again holds %s, want %s", got, want)
	}
}

// Acquisitions in atomic batches fence records whose history is full: a
// batch of 256 records of about 1.5 KB each lands whole, and each record
// then holds the newest FenceHistory acquisitions, its own last.
func TestBatchFencesFullHistories(t *testing.T) {
	t.Parallel()
	js, b := startBucket(t)
	ctx := ctxFor(t, 60*time.Second)
	const n = 256
	jobStream(t, js, b.Scope(), n, 0)
	var epochs []uint64
	var tokens []string
	for i := range coordinator.FenceHistory {
		epochs = append(epochs, uint64(1_000_000_000_000_000+i))
		tokens = append(tokens, fmt.Sprintf("%024x", i))
	}
	full, _ := json.Marshal(map[string]any{
		"epoch": epochs[len(epochs)-1], "acquisition": tokens[len(tokens)-1], "seq": 7, "holder": "old",
		"recent": epochs, "acquisitions": tokens,
	})
	for p := range n {
		if _, err := b.FenceRecords().Put(ctx, fmt.Sprintf("partition.%d", p), full); err != nil {
			t.Fatal(err)
		}
	}
	c := newCoord(t, b, "w", 10*time.Second)
	sess := renewedSession(t, c)
	leases, errs := c.AcquireBatch(ctx, partitionsUpTo(n), sess)
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if recs, fences := c.Batches(); recs != 1 || fences != 1 {
		t.Fatalf("%d batches of records and %d of fences landed, want 1 and 1", recs, fences)
	}
	for _, l := range leases {
		defer l.Release(ctx)
	}
	e, err := b.FenceRecords().Get(ctx, "partition.255")
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		Recent       []uint64 `json:"recent"`
		Acquisitions []string `json:"acquisitions"`
		Forgotten    uint64   `json:"forgotten"`
		Seq          uint64   `json:"seq"`
	}
	if err := json.Unmarshal(e.Value(), &rec); err != nil {
		t.Fatal(err)
	}
	l := leases[255].Info()
	if len(rec.Recent) != coordinator.FenceHistory || rec.Recent[0] != epochs[1] || rec.Forgotten != epochs[0] ||
		rec.Recent[len(rec.Recent)-1] != uint64(l.Epoch) || rec.Acquisitions[len(rec.Acquisitions)-1] != l.Acquisition || rec.Seq != 7 {
		t.Fatalf("record after the batch: %s", e.Value())
	}
	if err := verify(ctx, b, l.Fence(), leasehold.Epoch(epochs[1]), tokens[1]); err != nil {
		t.Fatalf("the oldest acquisition kept: %v", err)
	}
}

// A fence record rewritten by something other than an acquisition to
// name a forged acquisition at the live holder's epoch disagrees with the
// lease bucket, whose lease at that epoch names the holder: while they
// disagree neither acquisition is judged (a sink asks again later), and
// once the record is put back the forged one is refused and the holder's
// verified. Verified by the rewritten record, the forged stamp would fence
// the holder out.
func TestVerifyAcquisitionRecordRewrittenForAMoment(t *testing.T) {
	t.Parallel()
	_, b := startBucketWithJobs(t, 8, 0)
	ctx := ctxFor(t, 30*time.Second)
	l, err := newCoord(t, b, "a", 5*time.Second).Acquire(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	info := l.Info()
	orig := forgeRecordAcquisition(t, ctx, b, "partition.5", "forged")
	for _, a := range []string{"forged", info.Acquisition} {
		err := verify(ctx, b, info.Fence(), info.Epoch, a)
		var ni *coordinator.NotIssuedError
		if !errors.Is(err, coordinator.ErrTokenConflict) || errors.As(err, &ni) {
			t.Fatalf("acquisition %s while the record names another than the lease: %v, want an ErrTokenConflict that is no verdict", a, err)
		}
	}
	if _, err := b.FenceRecords().Put(ctx, "partition.5", orig); err != nil {
		t.Fatal(err)
	}
	wantNotIssued(t, "the forged acquisition once the record is back", verify(ctx, b, info.Fence(), info.Epoch, "forged"), coordinator.ReasonOtherAcquisition)
	if err := verify(ctx, b, info.Fence(), info.Epoch, info.Acquisition); err != nil {
		t.Fatalf("the holder once the record is back: %v", err)
	}
}

// Under a lease-bucket rollback (the bucket lost its last write, the fence
// records did not) one revision goes to two acquisitions: the first
// fenced the record and commits, the second fails its fence as a split
// brain but its lease write stays in the bucket until the key's next
// renewal or release. While the buckets disagree neither acquisition is
// judged; once the second lease ends, the record's acquisition, the one
// that commits, is verified and the other refused. Trusting the lease write
// while they disagree would refuse the committing holder's effects.
func TestVerifyAcquisitionAfterLeaseBucketRollback(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, 60*time.Second)
	b := provision(t, srv.JetStream(t), 1)
	jobStream(t, srv.JetStream(t), b.Scope(), 8, 0)
	const p = leasehold.Partition(6)
	srv.Shutdown()
	before := srv.Snapshot(t)
	srv.Restart(t)
	b = mustOpen(t, srv.JetStream(t), b.Name())
	first, err := newCoord(t, b, "a", time.Minute).Acquire(ctx, p, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	a1 := first.Info()

	// The lease bucket loses the acquisition; the fence records keep it.
	srv.Shutdown()
	fences := filepath.Join(srv.StoreDir(), "jetstream", "$G", "streams", "KV_"+b.FenceBucket())
	kept := filepath.Join(t.TempDir(), "fences")
	if err := os.CopyFS(kept, os.DirFS(fences)); err != nil {
		t.Fatal(err)
	}
	srv.Restore(t, before)
	if err := os.RemoveAll(fences); err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(fences, os.DirFS(kept)); err != nil {
		t.Fatal(err)
	}
	srv.Restart(t)
	b = mustOpen(t, srv.JetStream(t), b.Name())
	_, err = newCoord(t, b, "b", time.Minute).Acquire(ctx, p, coordinator.ManualRenew())
	if !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("the second acquisition of the revision: %v, want a split brain", err)
	}
	e, err := b.KeyValue().Get(ctx, fmt.Sprintf("partition.%d", p))
	if err != nil || e.Revision() != uint64(a1.Epoch) {
		t.Fatalf("the lease key after the rollback: %v, %v; want the second acquisition's write at revision %d", e, err, a1.Epoch)
	}
	var second struct {
		Token string `json:"token"`
	}
	if err := json.Unmarshal(e.Value(), &second); err != nil || second.Token == a1.Acquisition {
		t.Fatalf("the lease key holds %s, want the second acquisition's", e.Value())
	}
	for _, a := range []string{a1.Acquisition, second.Token} {
		if err := verify(ctx, b, a1.Fence(), a1.Epoch, a); !errors.Is(err, coordinator.ErrTokenConflict) {
			t.Fatalf("acquisition %s while the buckets disagree: %v, want ErrTokenConflict", a, err)
		}
	}
	// The second lease ends (it expires, or is released): the lease bucket
	// no longer shows who acquired the revision, and the record decides.
	if err := b.KeyValue().Purge(ctx, fmt.Sprintf("partition.%d", p)); err != nil {
		t.Fatal(err)
	}
	if err := verify(ctx, b, a1.Fence(), a1.Epoch, a1.Acquisition); err != nil {
		t.Fatalf("the acquisition that fenced the record, once the buckets agree: %v", err)
	}
	wantNotIssued(t, "the acquisition that lost the fence", verify(ctx, b, a1.Fence(), a1.Epoch, second.Token), coordinator.ReasonOtherAcquisition)
}
