package coordinator

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// Run joins the worker group and balances partitions until ctx ends: it
// registers this worker, watches the bucket, acquires the partitions the
// shared assignment gives it (calling OnAcquire), and hands off the ones it
// should no longer hold (OnRevoke, then Release). When ctx ends it
// deregisters, drains and releases everything it holds, and returns nil;
// it returns an error only if it cannot start.
func (c *Coordinator) Run(ctx context.Context) error {
	if c.cfg.Partitions <= 0 {
		return errors.New("coordinator: Run needs Config.Partitions")
	}
	g := &group{
		c:         c,
		n:         c.cfg.Partitions,
		held:      map[leasehold.Partition]*Lease{},
		draining:  map[leasehold.Partition]bool{},
		acquiring: map[leasehold.Partition]bool{},
		retryAt:   map[leasehold.Partition]time.Time{},
		heldBy:    map[leasehold.Partition]heldSeen{},
		strays:    map[leasehold.Partition]bool{},
		early:     map[leasehold.Partition][]byte{},
		foreign:   map[leasehold.Partition]foreignSeen{},
		revs:      newRevClock(staleAfter(0, c.cfg.TTL)),
		warned:    map[string]warning{},
		advCh:     make(chan advert, 1),
		strayCh:   make(chan strayResult, 16),
		watchCh:   make(chan watchEvent, 256),
		lostCh:    make(chan *Lease, 16),
		acqCh:     make(chan acquireResult, 16),
		drainCh:   make(chan drained, 16),
		done:      make(chan struct{}),
		sem:       make(chan struct{}, maxAcquiring),
		batchSize: maxBatch,
		batchMax:  maxBatch,
		mine:      -1,
	}
	c.setGroup(g)
	defer c.setGroup(nil)
	return g.run(ctx)
}

// Held returns the partition leases Run holds now, ordered by partition.
func (c *Coordinator) Held() []*Lease {
	c.mu.Lock()
	g := c.group
	c.mu.Unlock()
	if g == nil {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*Lease, 0, len(g.held))
	for _, l := range g.held {
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b *Lease) int { return int(a.info.Partition) - int(b.info.Partition) })
	return out
}

func (c *Coordinator) setGroup(g *group) {
	c.mu.Lock()
	c.group = g
	c.mu.Unlock()
}

type watchEvent struct {
	gen   int
	entry jetstream.KeyValueEntry // nil: the initial snapshot is complete
	err   error                   // the watcher ended
}

// drained is a revocation's end: the lease, and whether its release may
// have left its record behind.
type drained struct {
	l     *Lease
	stray bool
}

type acquireResult struct {
	p        leasehold.Partition
	lease    *Lease
	err      error
	takeover uint64    // the revision of the foreign record it was to replace
	started  time.Time // before its first write was sent
	batch    *acqBatch // the atomic batch it was part of, if any
}

// maxAcquiring bounds the acquisitions one member runs at once. Each is a
// few round trips (the lease key's create, the fence record's read and
// compare-and-set), so a member taking its share of a cold start waits on
// the server's write latency more than on its work: with sync_interval
// always each write waits for its fsync, and on a cluster for a quorum.
// 65,536 partitions over 64 members in one process (`go test
// ./cmd/leasehold/internal/bench -run '^$' -bench ScaleMax -benchtime 1x`, with `-args`
// -sync, -cluster, both or neither; 2 runs each) were held after 37.5 and
// 38.1 s at 8 (R1, sync always; 23.3 and 25.3 s on R3 with sync, 12.8 and
// 13.0 s on R3, 6.0 and 6.2 s on R1) and after 26.3 and 26.6 s at 64 (9.8
// and 11.1, 7.4 and 8.7, 5.1 and 5.1); 128 changed nothing more. On one
// server with sync always, 26 s is the server's own floor for writes one
// by one: the same 131,072 creates, pipelined from 64 connections without
// leasehold, took 24.8 and 26.3 s (the bench's scale_max_write_floor
// row). That is why a member whose membership has settled writes its
// acquisitions in atomic batches (batch.go), one batch at a time; what
// cannot go in a batch goes one by one, up to maxAcquiring at once.
//
// While membership is still changing (within RebalanceDelay of the last
// change a member saw), its view may lack members whose registrations
// are on their way, and what it takes on that view it may have to hand
// off again: it runs at most unsettledAcquiring then, as every member did
// before, and the full bound once membership has held still.
// TestAttackUnevenColdStartTakesEachPartitionOnce, beside two CPU-bound
// loops, failed 2 of 2 runs with 64 at once from the start (74 and 106
// acquisitions for 64 partitions).
const (
	maxAcquiring       = 64
	unsettledAcquiring = 8
)

// acquireBound is how many acquisitions may run now.
func (g *group) acquireBound() int {
	if time.Since(g.membersSince) < g.c.cfg.RebalanceDelay {
		return unsettledAcquiring
	}
	return maxAcquiring
}

type group struct {
	c *Coordinator
	n int

	mu        sync.Mutex // guards held for Held
	held      map[leasehold.Partition]*Lease
	draining  map[leasehold.Partition]bool
	acquiring map[leasehold.Partition]bool // the acquisitions running
	member    *Lease

	view, next    *view                             // next: the snapshot being read after a rescan
	retryAt       map[leasehold.Partition]time.Time // a failed acquisition is not retried before
	warned        map[string]warning                // what was last logged about each record (warnOnce)
	assigner      *assigner
	target        []int32               // the last reconciliation's assignment, by index in assigner
	mine          int32                 // this worker's index there; -1 when not a member
	queue         []leasehold.Partition // partitions it gives this worker, to acquire in turn
	ready         bool                  // the first snapshot is complete
	membersSince  time.Time             // when membership last changed
	revokePending bool                  // revocations wait for membership to settle
	gen           int                   // watcher generation
	snapshots     int                   // initial snapshots of the current watchers still coming
	stopWatch     context.CancelFunc
	watchers      sync.WaitGroup

	watchCh chan watchEvent
	lostCh  chan *Lease
	acqCh   chan acquireResult
	drainCh chan drained
	done    chan struct{}
	sem     chan struct{} // bounds concurrent acquisitions
	tasks   sync.WaitGroup

	// Acquisitions in atomic batches (batch.go).
	batches   int       // batches running: at most one
	batched   int       // the partitions in them
	batchSize int       // partitions the next batch may hold
	batchMax  int       // and at most: the server's limit, when below maxBatch
	batchOff  time.Time // batches refused often: none before

	// Without the partition records (see advert.go):
	watchParts bool                             // the current watchers read the partition records too
	heldBy     map[leasehold.Partition]heldSeen // partitions an acquisition found held: retried when the holder's list changes
	strays     map[leasehold.Partition]bool     // records this session may have left behind; true while one is being looked at
	early      map[leasehold.Partition][]byte   // the last notice naming a partition while it was being acquired
	strayCh    chan strayResult
	foreign    map[leasehold.Partition]foreignSeen // records leasehold did not write, as acquisitions found them
	revs       *revClock                           // dates the revisions the watch delivered, for foreign
	advCh      chan advert
	advDue     bool        // the holdings changed and advTimer runs
	advTimer   *time.Timer // writes the list when it fires
	advMember  *Lease      // the registration advHolds was handed over for
	advHolds   string      // the last list handed to the advertiser
	// selfUnlisted says that list did not fit in a message (listFits):
	// the registration lists none, and this worker watches the partition
	// records like every other member.
	selfUnlisted bool
	owners       []string // reconcile's, kept for the next one
}

func (g *group) run(ctx context.Context) error {
	log := g.c.cfg.Logger.With("worker", g.c.cfg.Worker)
	defer close(g.done)
	if err := g.register(ctx); err != nil {
		return err
	}
	g.watchParts = !g.c.sessions()
	g.view = newView(g.n, g.watchParts)
	if err := g.watch(ctx); err != nil {
		g.releaseMember()
		return err
	}
	log.Info("joined worker group", "partitions", g.n, "bucket", g.c.b.name)

	rescan := time.NewTicker(g.c.cfg.Rescan)
	defer rescan.Stop()
	tick := time.NewTicker(g.c.cfg.RenewEvery)
	defer tick.Stop()
	settle := time.NewTimer(time.Hour)
	settle.Stop()
	// Changes that arrive together are reconciled together, after a
	// pause that grows with the partition count: a reconciliation
	// computes the whole assignment, and when thousands of partitions
	// start at once every worker sees a change every few microseconds.
	pause := settlePause(g.n)
	g.advTimer = time.NewTimer(time.Hour)
	g.advTimer.Stop()
	defer g.advTimer.Stop()
	// The advertiser outlives ctx until the drain at shutdown is done, so
	// that partitions handed off on the way out are listed as free.
	actx, stopAdvertiser := context.WithCancel(context.WithoutCancel(ctx))
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		g.advertiser(actx)
	}()
	defer stopAdvertiser()
	dirty := false
	markDirty := func() {
		if !dirty {
			dirty = true
			settle.Reset(pause)
		}
	}

	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case ev := <-g.watchCh:
			if g.onWatch(ctx, ev) {
				markDirty()
			}
		case l := <-g.lostCh:
			if l.member {
				if g.member == l {
					g.member = nil
				}
			} else if g.held[l.info.Partition] == l && !g.draining[l.info.Partition] {
				g.drop(l)
				g.heldChanged()
			}
			markDirty()
		case r := <-g.acqCh:
			g.onAcquired(ctx, r)
			g.startQueued(ctx, time.Now())
			if g.view.partitions || !g.evenShares() {
				// Without the partition records, an acquisition changes
				// nothing the assignment depends on (see listMoved): one
				// that went as assigned keeps it, and one that failed is
				// tried again when the holder's list changes or at the
				// next tick.
				markDirty()
			}
		case d := <-g.drainCh:
			g.onDrained(d)
			markDirty()
		case r := <-g.strayCh:
			g.onStray(r)
			markDirty()
		case <-g.advTimer.C:
			g.flushAdvert()
			g.checkMode(ctx)
		case <-rescan.C:
			if err := g.watch(ctx); err != nil {
				log.Warn("rescan of the lease bucket failed; retrying at the next one", "err", err)
			}
		case <-tick.C:
			markDirty()
		case <-settle.C:
			dirty = false
			g.reconcile(ctx)
			if g.revokePending {
				dirty = true
				settle.Reset(g.c.cfg.RebalanceDelay - time.Since(g.membersSince))
			}
		}
	}
	g.shutdown(stopAdvertiser)
	log.Info("left worker group")
	return nil
}

// settlePause is how long a worker lets changes gather before it
// reconciles: 5 ms, and 5 ms more for every 1024 partitions. Computing the
// assignment takes up to about 0.1 ms per 1000 partitions over 32 members
// (BenchmarkAssign), so at 4096 partitions a worker that reconciled every
// 5 ms through a cold start spent a tenth of a core on it, and 32 such
// workers on a small machine starved the server they wait on; every 25 ms
// it is a fiftieth, and a hand-off waits 20 ms more, next to a lease TTL
// of seconds.
func settlePause(partitions int) time.Duration {
	return 5*time.Millisecond + time.Duration(partitions/1024)*5*time.Millisecond
}
