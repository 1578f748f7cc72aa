package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// onFirstUpdate calls f once, in a goroutine of its own, when kv shows the
// first write under filter after now; stop ends the watch and waits.
func onFirstUpdate(t *testing.T, kv jetstream.KeyValue, filter string, f func()) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w, err := kv.Watch(ctx, filter, jetstream.UpdatesOnly())
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for e := range w.Updates() {
			if e != nil {
				f()
				return
			}
		}
	}()
	return func() {
		_ = w.Stop()
		cancel()
		<-done
	}
}

// Members batching overlapping partitions on an R3 cluster while the
// leader of the lease bucket's stream, or of the fence records' stream, is
// killed the moment the first batch lands: every acquisition returns, with
// a lease or an error; no partition is given to two members; each winner's
// epoch is the revision of its record, read through the new leader, with
// its fence record at that epoch and acquisition; and epochs rise from
// round to round.
func TestAttackBatchesAcrossLeaderKill(t *testing.T) {
	const n, size, rounds = 128, 96, 4
	cl := natstest.StartCluster(t)
	js := cl.JetStream(t)
	b := provision(t, js, 3)
	v := newLeaderView(js, b)
	ctx := ctxFor(t, 3*time.Minute)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 3))
	watchJS := cl.JetStream(t)
	kv, err := watchJS.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	fkv, err := watchJS.KeyValue(ctx, b.FenceBucket())
	if err != nil {
		t.Fatal(err)
	}
	streams := []string{"KV_" + b.Name(), "KV_" + b.FenceBucket()}
	watched := []jetstream.KeyValue{kv, fkv}

	lastEpoch := map[leasehold.Partition]leasehold.Epoch{}
	var commitSeq uint64
	var won, failed int
	var landed, fenceLanded int64
	for round := range rounds {
		stream := streams[round%2]
		cs := []*contender{newContender(t, b, fmt.Sprintf("k%d-a", round)), newContender(t, b, fmt.Sprintf("k%d-b", round))}
		windows := [][]leasehold.Partition{window(rng, n, size), window(rng, n, size)}
		errs := make([][]error, len(cs))
		var wg sync.WaitGroup
		acquire := func(i int) {
			c := cs[i]
			wg.Go(func() {
				var leases []*coordinator.Lease
				leases, errs[i] = c.c.AcquireBatch(ctx, windows[i], c.sess)
				for k, l := range leases {
					if errs[i][k] == nil {
						c.leases[windows[i][k]] = l
					}
				}
			})
		}
		// The second member's batch goes out as the leader dies.
		killed := make(chan int, 1)
		stop := onFirstUpdate(t, watched[round%2], "partition.>", func() {
			i := cl.StreamLeader(t, stream, 20*time.Second)
			acquire(1)
			cl.Kill(i)
			killed <- i
		})
		acquire(0)
		var node int
		select {
		case node = <-killed:
		case <-ctx.Done():
			t.Fatalf("round %d: no write seen on %s", round, stream)
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-ctx.Done():
			t.Fatalf("round %d: acquisitions still running when the test's time ran out", round)
		}
		stop()
		cl.Restart(t, node)
		t.Logf("round %d: killed node %d, the leader of %s, as the first batch landed", round, node, stream)
		for _, s := range streams {
			cl.StreamLeader(t, s, 30*time.Second)
			cl.WaitStreamCurrent(t, s, 30*time.Second)
		}

		for i, c := range cs {
			recs, fences := c.c.Batches()
			landed, fenceLanded = landed+recs, fenceLanded+fences
			for k, err := range errs[i] {
				if err != nil && !errors.Is(err, coordinator.ErrHeld) {
					failed++
					t.Logf("round %d: %s: partition %d: %v", round, c.name, windows[i][k], err)
				}
			}
		}
		for p := range leasehold.Partition(n) {
			var owners []*contender
			for _, c := range cs {
				if c.leases[p] != nil {
					owners = append(owners, c)
				}
			}
			if len(owners) > 1 {
				t.Errorf("round %d: partition %d acquired by both members (epochs %d and %d)", round, p, owners[0].leases[p].Epoch(), owners[1].leases[p].Epoch())
				continue
			}
			if len(owners) == 0 {
				continue
			}
			l := owners[0].leases[p]
			won++
			v.checkLive(t, ctx, l, owners[0].sess)
			if l.Epoch() <= lastEpoch[p] {
				t.Errorf("round %d: partition %d acquired at epoch %d, not above its earlier %d", round, p, l.Epoch(), lastEpoch[p])
			}
			lastEpoch[p] = l.Epoch()
			commitSeq++
			// A commit whose outcome is not known (a cluster still
			// settling after the restart) is tried again; a refusal is a
			// failure.
			for {
				err := l.Commit(ctx, commitSeq)
				if err == nil {
					break
				}
				if errors.Is(err, leasehold.ErrLeaseLost) || ctx.Err() != nil {
					t.Errorf("round %d: partition %d: commit: %v", round, p, err)
					break
				}
				t.Logf("round %d: partition %d: commit not settled, trying again: %v", round, p, err)
			}
		}
		if t.Failed() {
			t.FailNow()
		}
		for _, c := range cs {
			for _, l := range c.leases {
				if err := l.Release(ctx); err != nil {
					t.Logf("round %d: %v", round, err)
				}
			}
			if err := c.sess.Release(ctx); err != nil {
				t.Logf("round %d: %v", round, err)
			}
		}
	}
	if won == 0 {
		t.Fatal("nothing was acquired")
	}
	t.Logf("%d acquisitions won; %d ended with an error other than ErrHeld; %d batches of records and %d of fences landed", won, failed, landed, fenceLanded)
}

// A worker group of session members on an R3 cluster, taking hundreds of
// partitions in atomic batches while members join in the middle of the
// cold start, one leaves and one crashes (its connection closed) in the
// middle of the rebalance that follows: the survivors end with every
// partition held exactly once and balanced, each at the revision of its
// own record, with its fence record at that epoch and acquisition, and no
// fence record's epoch ever went down.
func TestAttackGroupBatchesThroughChurnOnCluster(t *testing.T) {
	const n = 384
	cl := natstest.StartCluster(t)
	js := cl.JetStream(t)
	b := provision(t, js, 3)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ttl := 3 * time.Second
	conns := map[string]*nats.Conn{}
	ms := map[string]*member{}
	var mu sync.Mutex // guards ms for the watchers
	start := func(name string) {
		nc := cl.Connect(t)
		mjs, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		m := startSessionMember(t, mustOpen(t, mjs, b.Name()), name, n, ttl)
		mu.Lock()
		conns[name], ms[name] = nc, m
		mu.Unlock()
	}
	snapshot := func() map[string]*member {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(ms)
	}
	doubles := watchDoubles(t, snapshot, 2*ttl)
	for _, name := range []string{"a", "b", "c"} {
		start(name)
	}
	waitFor(t, 60*time.Second, "a third of the partitions acquired", func() bool { return acquisitions(snapshot()) >= n/3 })
	start("d")
	waitFor(t, 60*time.Second, "as many acquisitions as partitions", func() bool { return acquisitions(snapshot()) >= n })
	start("e")
	crashed := ms["c"]
	conns["c"].Close()
	ms["b"].stop(t)
	mu.Lock()
	delete(ms, "b")
	delete(ms, "c")
	mu.Unlock()
	for _, l := range crashed.c.Held() {
		select {
		case <-l.Done():
		case <-ctxFor(t, 30*time.Second).Done():
			t.Fatalf("the crashed member's lease on %d outlived its deadline", l.Partition())
		}
	}
	waitBalanced(t, snapshot(), n, 90*time.Second)

	checkHolders(t, ctxFor(t, time.Minute), v, snapshot())
	var recs, fences int64
	for _, m := range snapshot() {
		r, f := m.c.Batches()
		recs, fences = recs+r, fences+f
	}
	if s := wentDown(); s != "" {
		t.Error(s)
	}
	if s := doubles(); s != "" {
		t.Error(s)
	}
	if recs == 0 || fences == 0 {
		t.Errorf("%d batches of records and %d of fences landed: the group acquired one by one", recs, fences)
	}
	t.Logf("%d acquisitions, %d lapses; %d batches of records and %d of fences landed", acquisitions(snapshot()), lapses(snapshot()), recs, fences)
}
