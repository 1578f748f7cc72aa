package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/leader"
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
	c := newCoord(t, b, name, 10*time.Second)
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
	js, b := startBucket(t)
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
