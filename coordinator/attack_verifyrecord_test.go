package coordinator_test

import (
	"errors"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
)

// A credential that may write the fence-record bucket (every worker's
// may: the fence step and commits write it) rewrites a held partition's
// record so that its current acquisition is a token of its own, and puts
// it back a moment later. The live lease in the lease bucket still names
// the holder's token at that epoch the whole time, and no acquisition
// wrote the forged one: VerifyAcquisition must not verify the forged one
// (nor refuse the holder's) while the record is rewritten,
// or a sink that verifies then raises the partition's fence to the forged
// acquisition and refuses every write of the holder as a split brain.
// The holder notices nothing: its next commit is refused by revision,
// reads the record back, finds its own epoch and acquisition (the record
// was put back), and commits.
func TestAttackRewrittenFenceRecordNamesTheAcquisition(t *testing.T) {
	for _, mode := range []string{"session", "ttl"} {
		t.Run(mode, func(t *testing.T) {
			_, b := startBucketWithJobs(t, 4, 0)
			ctx := ctxFor(t, 30*time.Second)
			c := newCoord(t, b, "a", 5*time.Second)
			var l *coordinator.Lease
			var err error
			if mode == "session" {
				sess, serr := c.RegisterSession(ctx)
				if serr != nil {
					t.Fatal(serr)
				}
				sess.KeepRenewing()
				defer sess.Release(ctx)
				l, err = c.AcquireInSession(ctx, 1, sess)
			} else {
				l, err = c.Acquire(ctx, 1)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer l.Release(ctx)
			info := l.Info()
			if err := l.Commit(ctx, 7); err != nil {
				t.Fatal(err)
			}

			// The attacker reads the record and rewrites its acquisition.
			orig := forgeRecordAcquisition(t, ctx, b, "partition.1", "forgedacquisition")
			forgedErr := verify(ctx, b, info.Fence(), info.Epoch, "forgedacquisition")
			holderErr := verify(ctx, b, info.Fence(), info.Epoch, info.Acquisition)

			// It puts the record back; the holder commits on.
			if _, err := b.FenceRecords().Put(ctx, "partition.1", orig); err != nil {
				t.Fatal(err)
			}
			if err := l.Commit(ctx, 8); err != nil {
				t.Fatalf("the holder's commit after the record was put back: %v", err)
			}

			// The forged acquisition must not be verified; the holder's may
			// wait (an error that is no verdict: the sink asks again) but
			// must not be refused.
			if forgedErr == nil {
				t.Errorf("epoch %d with an acquisition no write of the lease bucket made was verified, while the live lease at that epoch names %s", info.Epoch, info.Acquisition)
			}
			var verdict interface{ Unverified() bool }
			if errors.As(holderErr, &verdict) && verdict.Unverified() {
				t.Errorf("the live holder's own epoch and acquisition were refused while the record was rewritten: %v", holderErr)
			}
			if err := verify(ctx, b, info.Fence(), info.Epoch, info.Acquisition); err != nil {
				t.Errorf("the holder's own epoch and acquisition once the record was put back: %v", err)
			}
		})
	}
}
