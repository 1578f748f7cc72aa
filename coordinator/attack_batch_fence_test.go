package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// watchFenceEpochs watches every fence record until the test ends and
// reports, through the returned function, the first one whose epoch went
// down: a fence record is only ever rewritten by a later acquisition.
func watchFenceEpochs(t *testing.T, b *coordinator.Bucket) func() string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w, err := b.FenceRecords().WatchAll(ctx)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	var found atomicString
	go func() {
		defer close(done)
		seen := map[string]uint64{}
		for e := range w.Updates() {
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			var r fenceRec
			if err := json.Unmarshal(e.Value(), &r); err != nil {
				found.set(fmt.Sprintf("fence record %s at revision %d does not decode: %v", e.Key(), e.Revision(), err))
				continue
			}
			if r.Epoch < seen[e.Key()] {
				found.set(fmt.Sprintf("fence record %s went from epoch %d down to %d at revision %d", e.Key(), seen[e.Key()], r.Epoch, e.Revision()))
			}
			seen[e.Key()] = max(seen[e.Key()], r.Epoch)
		}
	}()
	t.Cleanup(func() {
		_ = w.Stop()
		cancel()
		<-done
	})
	return found.get
}

type fenceResult struct {
	p     leasehold.Partition
	epoch leasehold.Epoch
}

// An operator's Fence racing members that batch the same partitions: every
// epoch a partition is given (to a batch or to a Fence) is new and above
// the epochs of earlier rounds, no fence record ever goes down, the fence
// record ends at the highest epoch given, the partition record left
// standing is a winner's own at its epoch, and every winner that Fence or
// another winner replaced has its commits refused.
func TestAttackBatchesRaceFence(t *testing.T) {
	const n, rounds = 32, 10
	js, b := startBucket(t)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ctx := ctxFor(t, 2*time.Minute)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	op := newCoord(t, b, "operator", 10*time.Second)

	lastEpoch := map[leasehold.Partition]leasehold.Epoch{}
	var commitSeq uint64
	var fenced, replaced int
	for round := range rounds {
		cs := []*contender{newContender(t, b, fmt.Sprintf("f%02d-a", round)), newContender(t, b, fmt.Sprintf("f%02d-b", round))}
		windows := [][]leasehold.Partition{window(rng, n, n), window(rng, n, n)}
		// Fences go on, over the partitions in a random order, for as long
		// as the batches run.
		order := window(rng, n, n)
		var mu sync.Mutex
		var fences []fenceResult
		start, batched := make(chan struct{}), make(chan struct{})
		var wg, bwg sync.WaitGroup
		errs := make([][]error, len(cs))
		for i, c := range cs {
			bwg.Go(func() {
				<-start
				var leases []*coordinator.Lease
				leases, errs[i] = c.c.AcquireBatch(ctx, windows[i], c.sess)
				for k, l := range leases {
					if errs[i][k] == nil {
						c.leases[windows[i][k]] = l
					}
				}
			})
		}
		for f := range 4 {
			wg.Go(func() {
				<-start
				for k := f; ; k += 4 {
					select {
					case <-batched:
						return
					default:
					}
					p := order[k%n]
					res, err := op.Fence(ctx, p)
					if err != nil {
						t.Errorf("round %d: fence partition %d: %v", round, p, err)
						return
					}
					mu.Lock()
					fences = append(fences, fenceResult{p, res.Epoch})
					mu.Unlock()
				}
			})
		}
		close(start)
		bwg.Wait()
		close(batched)
		wg.Wait()
		for i, c := range cs {
			for k, err := range errs[i] {
				// Held by the other member or the Fence, or refused at the
				// fence step by a Fence's later epoch.
				if err != nil && !errors.Is(err, coordinator.ErrHeld) && !errors.Is(err, leasehold.ErrLeaseLost) {
					t.Errorf("round %d: %s: partition %d: %v", round, c.name, windows[i][k], err)
				}
			}
		}

		given := map[leasehold.Partition][]leasehold.Epoch{}
		for _, f := range fences {
			given[f.p] = append(given[f.p], f.epoch)
		}
		fenced += len(fences)
		for p := range leasehold.Partition(n) {
			var ls []*coordinator.Lease
			var owners []*contender
			for _, c := range cs {
				if l := c.leases[p]; l != nil {
					ls, owners = append(ls, l), append(owners, c)
					given[p] = append(given[p], l.Epoch())
				}
			}
			top := lastEpoch[p]
			seen := map[leasehold.Epoch]bool{}
			for _, e := range given[p] {
				if seen[e] {
					t.Errorf("round %d: partition %d: epoch %d given twice (%v)", round, p, e, given[p])
				}
				seen[e] = true
				if e <= lastEpoch[p] {
					t.Errorf("round %d: partition %d: epoch %d given, not above the earlier %d", round, p, e, lastEpoch[p])
				}
				top = max(top, e)
			}
			if f := v.fence(t, ctx, p); f.Epoch != uint64(top) {
				t.Errorf("round %d: partition %d: fence record at epoch %d, the highest given is %d (%v)", round, p, f.Epoch, top, given[p])
			}
			r := v.record(t, ctx, p)
			standing := -1
			for i, l := range ls {
				if r.value && r.Token == l.Info().Acquisition {
					standing = i
				}
			}
			if r.value && standing < 0 {
				t.Errorf("round %d: partition %d: the record standing (revision %d, %s of %s) is no winner's", round, p, r.rev, r.Token, r.Holder)
			}
			commitSeq++
			for i, l := range ls {
				err := l.Commit(ctx, commitSeq)
				switch {
				case i == standing:
					v.checkLive(t, ctx, l, owners[i].sess)
					if err != nil {
						t.Errorf("round %d: partition %d: commit of the standing winner at epoch %d: %v", round, p, l.Epoch(), err)
					}
				case !errors.Is(err, leasehold.ErrLeaseLost):
					t.Errorf("round %d: partition %d: commit of the replaced winner at epoch %d: %v, want ErrLeaseLost", round, p, l.Epoch(), err)
				default:
					replaced++
				}
			}
			lastEpoch[p] = top
		}
		if s := wentDown(); s != "" {
			t.Error(s)
		}
		if t.Failed() {
			t.FailNow()
		}
		for _, c := range cs {
			for _, l := range c.leases {
				_ = l.Release(ctx)
			}
			if err := c.sess.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("%d Fences, %d winners replaced", fenced, replaced)
}

// onAcquiredOnce wraps a member's observer: the first acquisition of
// partition p runs f before the acquisition is handed to the group, as a
// slow hand-out would.
type onAcquiredOnce struct {
	coordinator.Observer
	p    leasehold.Partition
	once sync.Once
	f    func(leasehold.Lease)
}

func (o *onAcquiredOnce) LeaseEvent(ctx context.Context, e coordinator.Event) {
	if e.Kind == coordinator.EventAcquired && !e.Member && e.Lease.Partition == o.p {
		o.once.Do(func() { o.f(e.Lease) })
	}
	o.Observer.LeaseEvent(ctx, e)
}

// An operator's Fence of a partition that lands after a member has fenced
// the partition but before the member's group has taken the lease in (here
// the member's observer runs the Fence as it hears of the acquisition; in
// a batch the window is the whole fence batch and every hand-out after
// it): the notice Fence leaves names a lease the group does not hold yet.
// The member must still find out that its record is gone, end that lease
// and hold the partition again at a new epoch, within a few TTLs. Rescan
// is longer than a notice lives, so that only the notice can tell it.
// The same is checked for an acquisition one by one (a bucket without
// atomic batches).
func TestAttackFenceBeforeTheGroupTakesTheLeaseIn(t *testing.T) {
	for _, batches := range []bool{true, false} {
		name := "batch"
		if !batches {
			name = "one-by-one"
		}
		t.Run(name, func(t *testing.T) {
			const n, p = 64, leasehold.Partition(7)
			js, b := startBucket(t)
			if !batches {
				b = withoutAtomicBatches(t, js, b)
			}
			v := newLeaderView(js, b)
			kv, err := js.KeyValue(ctxFor(t, 10*time.Second), b.Name())
			if err != nil {
				t.Fatal(err)
			}
			op := newCoord(t, b, "operator", 10*time.Second)
			ttl := 2 * time.Second
			var fencedAt atomic.Int64
			m := startMemberWith(t, b, "a", n, ttl, func(cfg *coordinator.Config) {
				cfg.Rescan = 20 * time.Second
				cfg.Observer = &onAcquiredOnce{Observer: cfg.Observer, p: p, f: func(l leasehold.Lease) {
					res, err := op.Fence(ctxFor(t, 20*time.Second), p)
					if err != nil {
						t.Errorf("fence partition %d: %v", p, err)
						return
					}
					fencedAt.Store(int64(res.Epoch))
					// The notice is written before the group can have taken
					// the lease in: the acquisition is still being handed out.
					e, err := kv.Get(ctxFor(t, 10*time.Second), fmt.Sprintf("notice.a.%d", p))
					if err != nil {
						t.Errorf("Fence left no notice for a: %v", err)
						return
					}
					t.Logf("partition %d: acquired at epoch %d, fenced at epoch %d before the group took it in; notice %s", p, l.Epoch, res.Epoch, e.Value())
				}}
			})
			ctx := ctxFor(t, 3*ttl)
			waitUntil(t, ctx, "the member holds the fenced partition again, at its own record's revision", func() (bool, string) {
				for _, l := range m.c.Held() {
					if l.Partition() != p {
						continue
					}
					r := v.record(t, ctxFor(t, 10*time.Second), p)
					ok := fencedAt.Load() != 0 && int64(l.Epoch()) > fencedAt.Load() && r.value && r.rev == uint64(l.Epoch())
					return ok, fmt.Sprintf("it holds it at epoch %d (lease error: %v); the leader has value=%v at revision %d; Fence took epoch %d",
						l.Epoch(), l.Err(), r.value, r.rev, fencedAt.Load())
				}
				return false, "it does not hold it"
			})
			if recs, _ := m.c.Batches(); (recs > 0) != batches {
				t.Errorf("%d batches of records landed", recs)
			}
		})
	}
}

// checkHolders checks, through the stream leaders, the partitions the
// members hold: each record is its holder's own acquisition, a session
// member's at the revision that is its epoch, and each fence record holds
// that epoch and acquisition.
