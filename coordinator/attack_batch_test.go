package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/testing/natstest"
)

// leaderView reads partition and fence records through their streams'
// leaders, which no follower that is behind can answer.
type leaderView struct {
	b              *coordinator.Bucket
	leases, fences *leader.Reader
}

func newLeaderView(js jetstream.JetStream, b *coordinator.Bucket) *leaderView {
	return &leaderView{
		b:      b,
		leases: leader.NewReader(js, "KV_"+b.Name()),
		fences: leader.NewReader(js, "KV_"+b.FenceBucket()),
	}
}

// partRecord is a partition record as the stream leader has it.
type partRecord struct {
	value  bool   // a value, not a marker or nothing
	rev    uint64 // its revision (0: nothing)
	Holder string `json:"holder"`
	Token  string `json:"token"`
	// Session is the revision of the holder's registration that holds it.
	Session uint64 `json:"session"`
}

// fenceRec is a fence record as the stream leader has it.
type fenceRec struct {
	rev         uint64
	Epoch       uint64 `json:"epoch"`
	Acquisition string `json:"acquisition"`
	Seq         uint64 `json:"seq"`
}

// lastThroughLeader reads the last message on subject through r, retrying
// a read that fails (a cluster electing a leader) until ctx ends.
func lastThroughLeader(t *testing.T, ctx context.Context, r *leader.Reader, subject string) *leader.Msg {
	t.Helper()
	for {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		m, err := r.Last(rctx, subject)
		cancel()
		if err == nil {
			return m
		}
		select {
		case <-ctx.Done():
			t.Fatalf("read %s through the leader: %v", subject, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (v *leaderView) record(t *testing.T, ctx context.Context, p leasehold.Partition) partRecord {
	t.Helper()
	m := lastThroughLeader(t, ctx, v.leases, "$KV."+v.b.Name()+".partition."+p.String())
	if m == nil {
		return partRecord{}
	}
	r := partRecord{rev: m.Seq}
	if leader.IsMarker(m.Header) {
		return r
	}
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatalf("partition %d: record %q at revision %d does not decode: %v", p, m.Data, m.Seq, err)
	}
	r.value = true
	return r
}

func (v *leaderView) fence(t *testing.T, ctx context.Context, p leasehold.Partition) fenceRec {
	t.Helper()
	m := lastThroughLeader(t, ctx, v.fences, "$KV."+v.b.FenceBucket()+".partition."+p.String())
	if m == nil {
		return fenceRec{}
	}
	r := fenceRec{rev: m.Seq}
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatalf("fence record of partition %d (%q) does not decode: %v", p, m.Data, err)
	}
	return r
}

// checkLive checks a lease a batch handed out and nothing has replaced
// since: its epoch is the revision of its partition record, which names its
// acquisition, holder and session, and its fence record holds that epoch
// and acquisition.
func (v *leaderView) checkLive(t *testing.T, ctx context.Context, l, session *coordinator.Lease) {
	t.Helper()
	p, info := l.Partition(), l.Info()
	r := v.record(t, ctx, p)
	if !r.value || r.rev != uint64(l.Epoch()) || r.Token != info.Acquisition || r.Holder != info.Holder || r.Session != uint64(session.Epoch()) {
		t.Errorf("partition %d: lease of %s at epoch %d (acquisition %s, session %d); the leader has value=%v at revision %d naming %s of %s session %d",
			p, info.Holder, l.Epoch(), info.Acquisition, session.Epoch(), r.value, r.rev, r.Token, r.Holder, r.Session)
	}
	f := v.fence(t, ctx, p)
	if f.Epoch != uint64(l.Epoch()) || f.Acquisition != info.Acquisition {
		t.Errorf("partition %d: fence record holds epoch %d of %s, the lease epoch %d of %s", p, f.Epoch, f.Acquisition, l.Epoch(), info.Acquisition)
	}
}

// contender is a worker that acquires partitions in atomic batches under a
// renewed session of its own.
type contender struct {
	name   string
	c      *coordinator.Coordinator
	sess   *coordinator.Lease
	leases map[leasehold.Partition]*coordinator.Lease
}

func newContender(t *testing.T, b *coordinator.Bucket, name string) *contender {
	t.Helper()
	c := newSessionCoord(t, b, name, 10*time.Second)
	return &contender{name: name, c: c, sess: renewedSession(t, c), leases: map[leasehold.Partition]*coordinator.Lease{}}
}

// window is k partitions of 0 .. n-1 from a random offset on, wrapping, in
// a random order.
func window(rng *rand.Rand, n, k int) []leasehold.Partition {
	off := rng.IntN(n)
	ps := make([]leasehold.Partition, k)
	for i := range ps {
		ps[i] = leasehold.Partition((off + i) % n)
	}
	rng.Shuffle(len(ps), func(i, j int) { ps[i], ps[j] = ps[j], ps[i] })
	return ps
}

// What a holder from an earlier round does while a round's batches run.
const (
	keepHolding   = iota // holds on: nobody may take its partitions
	releaseLeases        // releases each lease, racing the batches
	endSession           // releases its registration: its records are free for takers
)

// Several members batching overlapping partitions at once, while earlier
// holders hold on, release their leases, or end their sessions under them:
// no partition is ever held by two leases, a partition free when a round
// starts goes to exactly one of the members that ask for it, the others are
// told it is held, and every winner's epoch is the revision of its own
// record, above every epoch the partition had, with its fence record
// holding that epoch and acquisition. A replaced holder's commits are
// refused.
func TestAttackBatchesRaceForOverlappingPartitions(t *testing.T) {
	const n, contenders, size, rounds = 64, 3, 40, 20
	js := natstest.Start(t).JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	ctx := ctxFor(t, 2*time.Minute)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))

	var (
		holders   []*contender // from earlier rounds, holding what leases they have
		lastEpoch = map[leasehold.Partition]leasehold.Epoch{}
		commitSeq uint64
		landed    int64
		won, held int
	)
	for round := range rounds {
		modes := make([]int, len(holders))
		heldBy := map[leasehold.Partition]*contender{} // live at the start
		for i, h := range holders {
			modes[i] = rng.IntN(3)
			for p := range h.leases {
				heldBy[p] = h
			}
		}
		var cs []*contender
		asked := map[leasehold.Partition][]*contender{}
		windows := make([][]leasehold.Partition, contenders)
		for i := range contenders {
			c := newContender(t, b, fmt.Sprintf("r%02d-%d", round, i))
			cs = append(cs, c)
			windows[i] = window(rng, n, size)
			for _, p := range windows[i] {
				asked[p] = append(asked[p], c)
			}
		}

		start := make(chan struct{})
		var wg sync.WaitGroup
		results := make([][]error, contenders)
		for i, c := range cs {
			wg.Go(func() {
				<-start
				leases, errs := c.c.AcquireBatch(ctx, windows[i], c.sess)
				results[i] = errs
				for k, l := range leases {
					if errs[k] == nil {
						c.leases[windows[i][k]] = l
					}
				}
			})
		}
		for i, h := range holders {
			switch modes[i] {
			case releaseLeases:
				for _, l := range h.leases {
					wg.Go(func() {
						<-start
						if err := l.Release(ctx); err != nil {
							t.Errorf("round %d: release of %s: %v", round, l, err)
						}
					})
				}
			case endSession:
				wg.Go(func() {
					<-start
					if err := h.sess.Release(ctx); err != nil {
						t.Errorf("round %d: release of %s's registration: %v", round, h.name, err)
					}
				})
			}
		}
		close(start)
		wg.Wait()

		for i, c := range cs {
			for k, err := range results[i] {
				if err != nil && !errors.Is(err, coordinator.ErrHeld) {
					t.Errorf("round %d: %s: partition %d: %v, want it acquired or ErrHeld", round, c.name, windows[i][k], err)
				}
			}
			recs, _ := c.c.Batches()
			landed += recs
		}
		for p := range leasehold.Partition(n) {
			var winners []*contender
			for _, c := range cs {
				if c.leases[p] != nil {
					winners = append(winners, c)
				}
			}
			prev := heldBy[p]
			keeping := false
			for i, h := range holders {
				if h == prev && modes[i] == keepHolding {
					keeping = true
				}
			}
			switch {
			case len(winners) > 1:
				t.Errorf("round %d: partition %d acquired by %s and %s at once (epochs %d and %d)", round, p,
					winners[0].name, winners[1].name, winners[0].leases[p].Epoch(), winners[1].leases[p].Epoch())
				continue
			case len(winners) == 1 && keeping:
				t.Errorf("round %d: partition %d acquired by %s at epoch %d while %s still held it at epoch %d", round, p,
					winners[0].name, winners[0].leases[p].Epoch(), prev.name, prev.leases[p].Epoch())
				continue
			case len(winners) == 0 && prev == nil && len(asked[p]) > 0:
				t.Errorf("round %d: partition %d was free and asked for by %d members, and none acquired it", round, p, len(asked[p]))
				continue
			case len(winners) == 0:
				if keeping {
					held++
					v.checkLive(t, ctx, prev.leases[p], prev.sess)
				}
				continue
			}
			w := winners[0]
			l := w.leases[p]
			won++
			v.checkLive(t, ctx, l, w.sess)
			if l.Epoch() <= lastEpoch[p] {
				t.Errorf("round %d: partition %d acquired at epoch %d, not above its earlier %d", round, p, l.Epoch(), lastEpoch[p])
			}
			lastEpoch[p] = l.Epoch()
			commitSeq++
			if err := l.Commit(ctx, commitSeq); err != nil {
				t.Errorf("round %d: partition %d: the winner's commit: %v", round, p, err)
			}
			if prev != nil {
				old := prev.leases[p]
				if err := old.Commit(ctx, commitSeq+1); !errors.Is(err, leasehold.ErrLeaseLost) {
					t.Errorf("round %d: partition %d: the replaced holder's commit at epoch %d: %v, want ErrLeaseLost", round, p, old.Epoch(), err)
				}
			}
		}
		if t.Failed() {
			t.FailNow()
		}

		next := cs
		for i, h := range holders {
			switch modes[i] {
			case keepHolding:
				next = append(next, h)
			case endSession:
				for p, l := range h.leases {
					select {
					case <-l.Done():
					case <-ctx.Done():
						t.Fatalf("round %d: %s's lease on %d outlived its registration", round, h.name, p)
					}
				}
			case releaseLeases:
				if err := h.sess.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
		}
		holders = next
	}
	if landed == 0 {
		t.Fatal("no batch of partition records landed: every acquisition went one by one")
	}
	t.Logf("%d acquisitions won, %d held partitions kept, %d batches of records landed", won, held, landed)
}

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
	js := natstest.Start(t).JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ctx := ctxFor(t, 2*time.Minute)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	op := newSessionCoord(t, b, "operator", 10*time.Second)

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

// logSignal closes a channel the first time a logger logs msg, at any
// level.
type logSignal struct {
	msg  string
	once sync.Once
	seen chan struct{}
}

func newLogSignal(msg string) *logSignal { return &logSignal{msg: msg, seen: make(chan struct{})} }

func (s *logSignal) Enabled(context.Context, slog.Level) bool { return true }
func (s *logSignal) Handle(_ context.Context, r slog.Record) error {
	if r.Message == s.msg {
		s.once.Do(func() { close(s.seen) })
	}
	return nil
}
func (s *logSignal) WithAttrs([]slog.Attr) slog.Handler { return s }
func (s *logSignal) WithGroup(string) slog.Handler      { return s }

// A batch whose commit reaches the server only after its member stopped
// waiting for the answer (the connection froze with the whole batch in
// it): the member goes one by one with the records the batch carried,
// finds its own tokens stored, and hands every partition out at the
// revision the batch stored it at, fenced, without a second record.
func TestAttackBatchLandsAfterItsAnswerWasGivenUp(t *testing.T) {
	const n = 50
	s := natstest.Start(t, natstest.Listen())
	js := s.JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	ctx := ctxFor(t, time.Minute)
	px := natstest.NewProxy(t, s.URL())
	nc, err := nats.Connect(px.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	jsP, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	gaveUp := newLogSignal("acquisition batch not written; acquiring its partitions one by one")
	c, err := coordinator.New(mustOpen(t, jsP, b.Name()), coordinator.Config{Worker: "w", TTL: 10 * time.Second, Partitions: n, Logger: slog.New(gaveUp)})
	if err != nil {
		t.Fatal(err)
	}
	sess := renewedSession(t, c)
	stream, err := js.Stream(ctx, "KV_"+b.Name())
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := info.State.LastSeq

	px.Freeze()
	ps := partitionsUpTo(n)
	type result struct {
		leases []*coordinator.Lease
		errs   []error
	}
	res := make(chan result, 1)
	go func() {
		leases, errs := c.AcquireBatch(ctx, ps, sess)
		res <- result{leases, errs}
	}()
	select {
	case <-gaveUp.seen:
	case <-ctx.Done():
		t.Fatal("the member never gave up on the frozen batch")
	}
	px.Thaw()
	r := <-res
	if err := errors.Join(r.errs...); err != nil {
		t.Fatal(err)
	}
	if recs, _ := c.Batches(); recs != 0 {
		t.Errorf("%d batches counted as landed; its answer was never read", recs)
	}
	first := r.leases[0].Epoch()
	for i, l := range r.leases {
		v.checkLive(t, ctx, l, sess)
		// The batch's revisions, in its order: not a second write.
		if l.Epoch() != first+leasehold.Epoch(i) {
			t.Errorf("partition %d at epoch %d, not %d where the batch stored it", l.Partition(), l.Epoch(), first+leasehold.Epoch(i))
		}
	}
	if info, err = stream.Info(ctx); err != nil {
		t.Fatal(err)
	}
	if info.State.LastSeq-before < n {
		t.Errorf("the lease stream advanced by %d for %d partitions", info.State.LastSeq-before, n)
	}
	t.Logf("lease stream advanced by %d revisions for %d partitions", info.State.LastSeq-before, n)
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
			js := natstest.Start(t).JetStream(t)
			b := provision(t, js, 1)
			if !batches {
				b = withoutAtomicBatches(t, js, b)
			}
			v := newLeaderView(js, b)
			kv, err := js.KeyValue(ctxFor(t, 10*time.Second), b.Name())
			if err != nil {
				t.Fatal(err)
			}
			op := newSessionCoord(t, b, "operator", 10*time.Second)
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
					e, err := kv.Get(ctxFor(t, 10*time.Second), "notice.a")
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
func checkHolders(t *testing.T, ctx context.Context, v *leaderView, ms map[string]*member) {
	t.Helper()
	for name, m := range ms {
		for _, l := range m.c.Held() {
			p := l.Partition()
			r := v.record(t, ctx, p)
			if !r.value || r.Holder != name || r.Token != l.Info().Acquisition || (r.Session != 0 && r.rev != uint64(l.Epoch())) {
				t.Errorf("partition %d: %s holds it at epoch %d; the leader has value=%v at revision %d of %s (session %d)", p, name, l.Epoch(), r.value, r.rev, r.Holder, r.Session)
			}
			if f := v.fence(t, ctx, p); f.Epoch != uint64(l.Epoch()) || f.Acquisition != l.Info().Acquisition {
				t.Errorf("partition %d: fence record at epoch %d of %s, %s holds epoch %d of %s", p, f.Epoch, f.Acquisition, name, l.Epoch(), l.Info().Acquisition)
			}
		}
	}
}

// A fleet that mixes session members with a member whose leases renew
// themselves makes the session members watch the partition records and
// batch what the view shows free at the revisions it shows: stale hints
// while the renewing member joins in the middle of a cold start and leaves
// again, and while a session member leaves, still end with every partition
// held once and balanced, each record its holder's own, and no fence
// record's epoch down.
func TestAttackMixedFleetBatchesOnViewHints(t *testing.T) {
	const n = 256
	js := natstest.Start(t).JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ttl := 5 * time.Second
	ms := map[string]*member{
		"a": startSessionMember(t, b, "a", n, ttl),
		"b": startSessionMember(t, b, "b", n, ttl),
		"c": startSessionMember(t, b, "c", n, ttl),
	}
	waitFor(t, 60*time.Second, "a quarter of the partitions acquired", func() bool { return acquisitions(ms) >= n/4 })
	ms["r"] = startRenewingMember(t, b, "r", n, ttl)
	waitBalanced(t, ms, n, 60*time.Second)
	ms["r"].stop(t)
	delete(ms, "r")
	ms["b"].stop(t)
	delete(ms, "b")
	ms["d"] = startSessionMember(t, b, "d", n, ttl)
	waitBalanced(t, ms, n, 60*time.Second)
	checkHolders(t, ctxFor(t, time.Minute), v, ms)
	if s := wentDown(); s != "" {
		t.Error(s)
	}
	var recs int64
	for _, m := range ms {
		r, _ := m.c.Batches()
		recs += r
	}
	t.Logf("%d acquisitions, %d batches of records landed", acquisitions(ms), recs)
}

// A server that takes batches of at most 16 messages, and one open batch
// per stream at a time, refuses a member's first batches of a cold start
// as too large: the member halves its batches until they land and takes
// what was refused one by one; members joining then take their shares
// while the first hands them off, and the group ends with every partition
// held once and balanced, each at its own record's revision and fenced.
func TestAttackGroupBatchesUnderTightServerLimits(t *testing.T) {
	const n = 600
	js := natstest.Start(t, natstest.Tweak(func(o *server.Options) {
		o.JetStreamLimits.MaxBatchSize = 16
		o.JetStreamLimits.MaxBatchInflightPerStream = 1
	})).JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ms := map[string]*member{"a": startSessionMember(t, b, "a", n, 5*time.Second)}
	waitBalanced(t, ms, n, 60*time.Second)
	if recs, _ := ms["a"].c.Batches(); recs == 0 {
		t.Error("no batch landed: the member never shrank its batches to what the server takes")
	}
	for _, name := range []string{"b", "c"} {
		ms[name] = startSessionMember(t, b, name, n, 5*time.Second)
	}
	waitBalanced(t, ms, n, 60*time.Second)
	checkHolders(t, ctxFor(t, time.Minute), v, ms)
	if s := wentDown(); s != "" {
		t.Error(s)
	}
	var recs, fences int64
	for _, m := range ms {
		r, f := m.c.Batches()
		recs, fences = recs+r, fences+f
	}
	t.Logf("%d acquisitions; %d batches of records and %d of fences landed", acquisitions(ms), recs, fences)
}

// Members batching the partitions of a member whose registration stopped
// renewing: they start as its local deadline passes, before the server
// has expired the registration, and try again once a watch shows it
// expired. Each partition goes to exactly one of them, at an epoch above
// the old holder's, never before the old holder's local deadline had
// passed; the old holder's commits are refused.
func TestAttackBatchesTakeOverAnExpiringSession(t *testing.T) {
	const n = 48
	js := natstest.Start(t).JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	ctx := ctxFor(t, time.Minute)
	kv, err := js.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	old := newSessionCoord(t, b, "old", time.Second)
	expired, err := kv.Watch(ctx, "member.old", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	osess, err := old.RegisterListingSession(ctx) // never renewed
	if err != nil {
		t.Fatal(err)
	}
	ps := partitionsUpTo(n)
	oldLeases, errs := old.AcquireBatch(ctx, ps, osess)
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	cs := []*contender{newContender(t, b, "x"), newContender(t, b, "y")}
	defer expired.Stop()
	<-osess.Done()
	deadline := osess.Deadline()
	race := func(round string) {
		var wg sync.WaitGroup
		for i, c := range cs {
			order := slices.Clone(ps)
			rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			wg.Go(func() {
				leases, errs := c.c.AcquireBatch(ctx, order, c.sess)
				for k, err := range errs {
					switch {
					case err == nil:
						c.leases[order[k]] = leases[k]
					case !errors.Is(err, coordinator.ErrHeld):
						t.Errorf("%s: member %d: partition %d: %v", round, i, order[k], err)
					}
				}
			})
		}
		wg.Wait()
	}
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for e := range expired.Updates() {
			if e != nil && e.Operation() != jetstream.KeyValuePut {
				return
			}
		}
	}()
	// Batches go out back to back from the local deadline on, across the
	// server's expiry, and once more after the watch has shown it.
	races := 0
	for done := false; !done; {
		select {
		case <-gone:
			done = true
		default:
		}
		race(fmt.Sprintf("race %d", races))
		races++
	}
	t.Logf("%d rounds of batches from the local deadline to past the expiry", races)
	for _, p := range ps {
		var winners []*contender
		for _, c := range cs {
			if c.leases[p] != nil {
				winners = append(winners, c)
			}
		}
		if len(winners) != 1 {
			t.Errorf("partition %d: %d winners", p, len(winners))
			continue
		}
		l, ol := winners[0].leases[p], oldLeases[p]
		v.checkLive(t, ctx, l, winners[0].sess)
		if l.Epoch() <= ol.Epoch() {
			t.Errorf("partition %d taken over at epoch %d, not above the old %d", p, l.Epoch(), ol.Epoch())
		}
		if m := lastThroughLeader(t, ctx, v.leases, "$KV."+b.Name()+".partition."+p.String()); !m.Time.After(deadline) {
			t.Errorf("partition %d taken over at %v, before the old holder's deadline %v", p, m.Time, deadline)
		}
		if err := ol.Commit(ctx, 1); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Errorf("partition %d: the old holder's commit: %v, want ErrLeaseLost", p, err)
		}
	}
}
