package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
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
// ./internal/bench -run '^$' -bench ScaleMax -benchtime 1x`, with `-args`
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

// watch starts new watchers on the partition and member keys; their
// initial snapshots replace the view once both are complete.
//
// Two watchers with one filter each, not one with both filters: the
// server finds a multi-filter consumer's next message by intersecting
// its filters with every subject in the bucket, for every message, and
// with thousands of partitions and dozens of workers that alone saturates
// it. A single-filter consumer at the tail of the stream scans forward.
func (g *group) watch(ctx context.Context) error {
	wctx, cancel := context.WithCancel(ctx)
	var ws []jetstream.KeyWatcher
	filters := []string{memberKeyPrefix + ">", noticeKey(g.c.cfg.Worker)}
	if g.watchParts {
		filters = append(filters, partitionKeyPrefix+">")
	}
	for _, filter := range filters {
		w, err := g.c.b.kv.Watch(wctx, filter)
		if err != nil {
			for _, w := range ws {
				_ = w.Stop()
			}
			cancel()
			return fmt.Errorf("coordinator: watch lease bucket %s: %w", g.c.b.name, err)
		}
		ws = append(ws, w)
	}
	if g.stopWatch != nil {
		g.stopWatch()
	}
	g.gen++
	g.stopWatch = cancel
	g.next = newView(g.n, g.watchParts)
	g.snapshots = len(ws)
	gen := g.gen
	for _, w := range ws {
		g.watchers.Add(1)
		go func() {
			defer g.watchers.Done()
			defer stopWatcher(w)
			for {
				select {
				case e, ok := <-w.Updates():
					if !ok {
						g.send(wctx, watchEvent{gen: gen, err: errors.New("watcher closed")})
						return
					}
					if !g.send(wctx, watchEvent{gen: gen, entry: e}) {
						return
					}
				case <-wctx.Done():
					return
				}
			}
		}()
	}
	return nil
}

// stopWatcher stops w and takes what it still delivers until nats.go
// closes its channel: nats.go's delivery goroutine may be blocked on a full
// channel, and nothing else would ever unblock it.
func stopWatcher(w jetstream.KeyWatcher) {
	_ = w.Stop()
	t := time.NewTimer(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case _, ok := <-w.Updates():
			if !ok {
				return
			}
		case <-t.C:
			return
		}
	}
}

func (g *group) send(wctx context.Context, ev watchEvent) bool {
	select {
	case g.watchCh <- ev:
		return true
	case <-wctx.Done():
		return false
	}
}

// onWatch folds a watch event into the view; it reports whether the
// assignment may have changed.
func (g *group) onWatch(ctx context.Context, ev watchEvent) bool {
	if ev.gen != g.gen {
		return false // from a watcher a rescan replaced
	}
	if ev.err != nil {
		if ctx.Err() == nil {
			g.c.cfg.Logger.Warn("lease bucket watch ended; restarting it", "err", ev.err)
			if err := g.watch(ctx); err != nil {
				g.c.cfg.Logger.Warn("restart of the lease bucket watch failed; retrying at the next rescan", "err", err)
			}
		}
		return false
	}
	if ev.entry != nil {
		g.revs.saw(ev.entry.Revision(), time.Now())
	}
	if g.next != nil {
		if ev.entry != nil {
			g.noticeRewrite(ev.entry)
			if ev.entry.Key() == noticeKey(g.c.cfg.Worker) && ev.entry.Operation() == jetstream.KeyValuePut {
				g.onNotice(ctx, ev.entry.Value())
			}
			g.next.apply(ev.entry)
			return false
		}
		if g.snapshots--; g.snapshots > 0 {
			return false // the other watcher's snapshot is still coming
		}
		g.next.inherit(g.view)
		g.view, g.next, g.ready = g.next, nil, true
		g.checkMode(ctx)
		return true
	}
	if ev.entry == nil {
		return false
	}
	g.noticeRewrite(ev.entry)
	key := ev.entry.Key()
	if key == noticeKey(g.c.cfg.Worker) {
		if ev.entry.Operation() == jetstream.KeyValuePut {
			g.onNotice(ctx, ev.entry.Value())
		}
		return false
	}
	var before *member
	isMember := strings.HasPrefix(key, memberKeyPrefix)
	if isMember {
		before = g.view.members[key[len(memberKeyPrefix):]]
	}
	changed, membership := g.view.applyKind(ev.entry)
	if membership {
		g.membersSince = time.Now()
	}
	if isMember && changed {
		id := key[len(memberKeyPrefix):]
		g.listChanged(id)
		g.checkMode(ctx)
		if !membership && !g.view.partitions && before != nil {
			if after := g.view.members[id]; after != nil && before.adverts && after.adverts {
				return g.listMoved(ctx, id, before.holds, after.holds)
			}
		}
	}
	return changed
}

// reconcile compares the shared assignment with what this worker holds:
// it acquires free partitions assigned to it and revokes held partitions
// assigned elsewhere.
func (g *group) reconcile(ctx context.Context) {
	if !g.ready || (!g.view.partitions && g.watchParts) {
		return // the partition records are needed, and their snapshot is not in yet
	}
	me := g.c.cfg.Worker
	if g.member == nil {
		// Lost the registration (a pause, a partition from the server):
		// register again before taking anything.
		rctx, cancel := context.WithTimeout(ctx, 2*g.c.cfg.RequestTimeout)
		started := time.Now()
		l, err := g.c.acquireKey(rctx, memberTarget(me), acquireOpts{advertise: g.c.sessions()})
		cancel()
		if err == nil {
			l.startKeepalive()
			g.member = l
			g.watchLoss(l)
			g.wrote(uint64(l.info.Epoch), started)
			clear(g.strays) // an ended session's records are free to all
		}
	}
	now := time.Now()
	members := make([]string, 0, len(g.view.members)+1)
	for id, m := range g.view.members {
		if id == me {
			continue
		}
		if m.suspect(now, g.c.cfg.TTL) {
			g.checkMember(ctx, id, m)
		}
		if m.dead() {
			g.warnOnce(memberKey(id), m.rev, "a member record that is not a live registration: ignoring it; `leasehold fence --repair` removes it",
				"worker", id, "does_not_decode", m.foreign, "no_ttl", m.ttlless)
			continue
		}
		members = append(members, id)
	}
	if g.member != nil {
		members = append(members, me)
	}
	if len(g.owners) != g.n {
		g.owners = make([]string, g.n)
	}
	owners := g.owners
	clear(owners)
	var orphans []int
	if !g.view.partitions {
		g.listed(owners, members)
	}
	for p := range g.view.slots {
		if !g.view.partitions {
			break
		}
		s := &g.view.slots[p]
		owners[p] = s.holder
		if s.holder != me && s.session != 0 && !g.sessionLive(*s) {
			// Held by a session its holder no longer has (it lost it and
			// registered again): free, for every worker alike. Counting it
			// as the holder's would keep it assigned to a worker that,
			// seeing a record of its own it does not hold, counts it as
			// free and may give it to another: nobody would take it.
			owners[p] = ""
		}
		if s.holder == me {
			owners[p] = "" // ours on the server, but not (or no longer) held here
			if s.session != 0 && g.member != nil && s.session == uint64(g.member.info.Epoch) &&
				g.held[leasehold.Partition(p)] == nil && !g.acquiring[leasehold.Partition(p)] {
				orphans = append(orphans, p)
			}
		}
	}
	for p := range g.held {
		owners[p] = me
	}
	if g.assigner == nil {
		g.assigner = newAssigner(g.n)
	}
	g.assigner.setMembers(members)
	target := g.assigner.assign(owners)
	mine := g.assigner.indexOf(me) // -1 without a registration: nothing is ours

	settled := time.Since(g.membersSince) >= g.c.cfg.RebalanceDelay || g.member == nil
	g.revokePending = false
	for p, l := range g.held {
		if (mine < 0 || target[p] != mine) && !g.draining[p] {
			if !settled {
				g.revokePending = true
				continue
			}
			g.draining[p] = true
			g.revoke(l)
		}
	}
	for _, p := range orphans {
		if target[p] != mine {
			g.purgeOrphan(ctx, leasehold.Partition(p), g.view.slots[p].rev)
		}
	}
	for p, looking := range g.strays {
		switch {
		case g.held[p] != nil:
			delete(g.strays, p)
		case !looking && !g.acquiring[p] && target[p] != mine:
			g.checkStray(ctx, p)
		}
	}
	// The partitions to take, lowest first, wait in a queue that this
	// reconciliation replaces: when workers start together, the first to
	// look sees itself alone and wants every partition, and taking them all
	// only to hand nearly all of them off again is most of what a cold
	// start would cost. A queued partition costs an entry, not a goroutine:
	// at 65,536 partitions a goroutine each was most of a cold start's
	// memory.
	g.target, g.mine = target, mine
	g.queue = g.queue[:0]
	room, bounded := g.roomBeforeExtra(members)
	for i, m := range target {
		p := leasehold.Partition(i)
		if bounded && room <= 0 {
			break
		}
		if m == mine && mine >= 0 && g.held[p] == nil && !g.acquiring[p] && !g.strays[p] && !now.Before(g.retryAt[p]) {
			g.queue = append(g.queue, p)
			room--
		}
	}
	g.startQueued(ctx, now)
}

// roomBeforeExtra bounds, without the partition records, the partitions
// this worker queues to the base share (partitions / members) while
// another member lists fewer than that: the extra partitions (partitions
// % members) go to the members that hold the most, and a worker counts
// its own holdings as they are but the others' as their lists last said,
// a settle pause, a write and a delivery behind. In a cold start two
// workers would each find themselves ahead and both take the extra one,
// and one of them hand it off again. Once every other member lists its
// base share, the workers rank from the same counts, ties by name. A
// member whose short list has not changed for a renewal interval is not
// filling it (it waits on a partition someone holds, or does not work at
// all), and holds back nobody's extra partitions.
func (g *group) roomBeforeExtra(members []string) (room int, bounded bool) {
	k := len(members)
	if g.view.partitions || k == 0 || g.n%k == 0 {
		return 0, false
	}
	base := g.n / k
	for _, id := range members {
		if id == g.c.cfg.Worker {
			continue
		}
		if m := g.view.members[id]; m != nil && len(m.holds) < base && time.Since(m.listSince) < g.c.cfg.RenewEvery {
			return base - (len(g.held) - len(g.draining) + len(g.acquiring)), true
		}
	}
	return 0, false
}

// startQueued starts queued acquisitions while fewer than the group's
// bound run.
func (g *group) startQueued(ctx context.Context, now time.Time) {
	sess := g.member
	if g.c.sessions() && sess == nil {
		return // nothing can be taken without a session
	}
	if !g.c.sessions() {
		sess = nil
	}
	me := g.c.cfg.Worker
	bound := g.acquireBound()
	// Once membership has held still, a member takes what it is given in
	// atomic batches, one batch at a time (see batch.go); what cannot go
	// in one goes one by one beside it.
	batching := sess != nil && g.c.b.atomic && bound == maxAcquiring && !now.Before(g.batchOff)
	var batch []batchItem
	for len(g.queue) > 0 && len(g.acquiring)-g.batched-len(batch) < bound {
		if batching && g.batches > 0 {
			break // taken by the next batch
		}
		p := g.queue[0]
		g.queue = g.queue[1:]
		if int(p) >= len(g.target) || g.target[p] != g.mine || g.held[p] != nil || g.acquiring[p] || g.strays[p] || now.Before(g.retryAt[p]) {
			continue
		}
		var takeover, hint, orphan uint64
		if !g.view.partitions {
			// Nothing is known of the record but what acquisitions found:
			// the acquisition reads it when its write is refused.
			orphan = g.unlisted(p, now)
			if f, ok := g.foreign[p]; ok && now.Sub(f.since) > staleAfter(0, g.c.cfg.TTL) {
				takeover = f.rev
				g.warnOnce(partitionKey(p), f.rev, "partition record leasehold did not write has stayed unchanged for longer than a lease can: taking the partition over",
					"partition", p, "revision", f.rev, "unchanged_for", now.Sub(f.since).Round(time.Millisecond))
			}
		}
		var s slot
		if g.view.partitions {
			s = g.view.slots[p]
		}
		switch {
		case !g.view.partitions:
		case s.holder == "":
			hint = s.rev
		case s.session != 0:
			if g.sessionLive(s) {
				continue
			}
			// The view says its session ended; the acquisition checks that
			// through the leader unless it is known already.
			if s.holder == me || g.c.ended.has(sessionKey{s.holder, s.session}) {
				hint = s.rev
			}
		default:
			if !s.stuck(now, g.c.cfg.TTL) {
				continue
			}
			// Its record has outlived any lease: the server does not
			// expire it. The acquisition checks that through the leader
			// and overwrites exactly this revision.
			takeover = s.rev
			g.warnOnce(partitionKey(p), s.rev, "partition record has stayed unchanged for longer than a lease can: taking the partition over",
				"partition", p, "revision", s.rev, "holder", s.holder, "unchanged_for", now.Sub(s.since).Round(time.Millisecond))
		}
		g.acquiring[p] = true
		if batching && takeover == 0 && orphan == 0 && (!g.view.partitions || s.holder == "") {
			// Its record is expected at hint, or empty: nothing to read
			// through the leader first.
			batch = append(batch, batchItem{p: p, hint: hint})
			if len(batch) == g.batchSize {
				g.startBatch(ctx, batch, sess)
				batch = nil
			}
			continue
		}
		g.startOne(ctx, p, acquireOpts{takeover: takeover, session: sess, hint: hint, orphan: orphan})
	}
	switch {
	case len(batch) == 1:
		g.startOne(ctx, batch[0].p, acquireOpts{session: sess, hint: batch[0].hint})
	case len(batch) > 1:
		g.startBatch(ctx, batch, sess)
	}
}

// startOne starts the acquisition of p, marked as acquiring.
func (g *group) startOne(ctx context.Context, p leasehold.Partition, o acquireOpts) {
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		select {
		case g.sem <- struct{}{}:
		case <-ctx.Done():
			g.acqCh <- acquireResult{p: p, err: fmt.Errorf("coordinator: acquire partition %d: %w", p, ctx.Err())}
			return
		}
		defer func() { <-g.sem }()
		// Once started, an acquisition runs to its end under the
		// group's context: its outcome is settled, not abandoned.
		actx, cancel := context.WithTimeout(ctx, g.c.cfg.TTL)
		defer cancel()
		started := time.Now()
		l, err := g.c.acquire(actx, partitionTarget(p), o)
		g.acqCh <- acquireResult{p: p, lease: l, err: err, takeover: o.takeover, started: started}
	}()
}

// startBatch starts the acquisition of items, marked as acquiring, in
// atomic batches.
func (g *group) startBatch(ctx context.Context, items []batchItem, sess *Lease) {
	b := &acqBatch{size: len(items), left: len(items)}
	g.batches++
	g.batched += len(items)
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		// Like one acquisition, a batch runs to its end: its outcome is
		// settled, not abandoned.
		actx, cancel := context.WithTimeout(ctx, g.c.cfg.TTL)
		defer cancel()
		for _, r := range g.c.acquireBatch(actx, items, sess, b) {
			r.batch = b
			g.acqCh <- r
		}
	}()
}

// batchDone counts one result of batch b, and sizes the next batch once
// all of b's are in.
func (g *group) batchDone(b *acqBatch) {
	g.batched--
	if b.left--; b.left > 0 {
		return
	}
	g.batches--
	if b.landed {
		g.batchSize = min(2*g.batchSize, g.batchMax)
		return
	}
	if batchTooLarge(b.err) {
		g.batchMax = max(b.size/2, minBatch)
	}
	if g.batchSize = min(b.size/2, g.batchMax); g.batchSize < minBatch {
		// Batches keep failing here: go one by one for a while.
		g.batchSize, g.batchOff = minBatch, time.Now().Add(g.c.cfg.RenewEvery)
		g.c.cfg.Logger.Warn("atomic batches of acquisitions keep failing; acquiring one by one for a while", "worker", g.c.cfg.Worker, "retry_in", g.c.cfg.RenewEvery, "err", b.err)
	}
}

func (g *group) onAcquired(ctx context.Context, r acquireResult) {
	delete(g.acquiring, r.p)
	early, noticed := g.early[r.p]
	delete(g.early, r.p)
	if r.batch != nil {
		g.batchDone(r.batch)
	}
	if r.err != nil {
		var (
			held    *HeldError
			foreign *ForeignRecordError
		)
		switch {
		case errors.Is(r.err, context.Canceled):
			// The group is leaving.
		case errors.As(r.err, &held) && r.takeover == 0 && !g.view.partitions:
			// Taken before its holder's list said so, or listed by no one
			// (a release of its holder's that failed, which it removes
			// itself): tried again when that member's list changes, or
			// after a renewal interval.
			rev := uint64(held.Lease.Epoch) // a session-held record is written once, at its epoch
			if h, ok := g.heldBy[r.p]; !ok || h.holder != held.Lease.Holder || h.rev != rev {
				g.heldBy[r.p] = heldSeen{holder: held.Lease.Holder, rev: rev, since: time.Now()}
			}
			if m := g.view.members[held.Lease.Holder]; m != nil && m.listSince.After(r.started) {
				// The holder's list changed while this acquisition ran (a
				// batch's results come when the whole batch is done): the
				// change that lets it try again is in already. Once per
				// change: the next attempt starts after it.
				g.queue = append(g.queue, r.p)
				break
			}
			g.retryAt[r.p] = time.Now().Add(g.c.cfg.RenewEvery)
		case errors.As(r.err, &held) && r.takeover == 0:
			s := &g.view.slots[r.p]
			if s.holder != held.Lease.Holder || s.epoch != held.Lease.Epoch {
				s.holder, s.epoch, s.sum = held.Lease.Holder, held.Lease.Epoch, 0
			}
			if s.session != 0 {
				// The view thought the holder's session over, and the
				// leader says it is not: the member watch is behind.
				g.retryAt[r.p] = time.Now().Add(g.c.cfg.RenewEvery)
			}
		case errors.As(r.err, &foreign):
			now := time.Now()
			f, ok := g.foreign[r.p]
			if !ok || f.rev != foreign.Revision {
				// Dated by the watch: a record nobody watched may have
				// stood long before this acquisition met it.
				f = foreignSeen{rev: foreign.Revision, since: g.revs.since(foreign.Revision, now)}
				g.foreign[r.p] = f
			}
			if !g.view.partitions && r.takeover != f.rev && now.Sub(f.since) > staleAfter(0, g.c.cfg.TTL) {
				// It has stood longer than a lease can already: take it
				// over now rather than at the next tick.
				g.queue = append([]leasehold.Partition{r.p}, g.queue...)
				break
			}
			// It is taken over once it is stuck; until then, do not spin
			// on it.
			g.retryAt[r.p] = now.Add(g.c.cfg.RenewEvery)
			g.warnOnce(foreign.Key, foreign.Revision, "partition record is not a lease leasehold wrote: taking the partition over if it stays unchanged for a TTL",
				"partition", r.p, "revision", foreign.Revision, "reason", foreign.Reason)
		default:
			// Not retried before a renewal interval has passed: a record
			// that keeps an acquisition failing must not make it spin.
			g.retryAt[r.p] = time.Now().Add(g.c.cfg.RenewEvery)
			g.c.cfg.Logger.Warn("acquire failed; retrying", "partition", r.p, "err", r.err)
			if g.c.sessions() {
				// Its outcome is not known: a record may be stored under
				// this worker's session.
				g.strays[r.p] = false
			}
		}
		return
	}
	delete(g.retryAt, r.p)
	delete(g.heldBy, r.p)
	delete(g.foreign, r.p)
	delete(g.strays, r.p)
	l := r.lease
	g.wrote(uint64(l.info.Epoch), r.started)
	if r.takeover != 0 {
		g.c.cfg.Logger.Warn("took the partition over from a record the server did not expire", "partition", r.p, "revision", r.takeover, "epoch", l.info.Epoch)
	}
	g.mu.Lock()
	g.held[r.p] = l
	g.mu.Unlock()
	s := slot{holder: l.info.Holder, epoch: l.info.Epoch, rev: uint64(l.info.Epoch), since: time.Now(), ttl: g.c.cfg.TTL}
	if l.session != nil {
		s.session, s.ttl = uint64(l.session.info.Epoch), 0
	}
	if g.view.partitions {
		g.view.slots[r.p] = s
	}
	g.watchLoss(l)
	g.heldChanged()
	if g.c.cfg.OnAcquire != nil {
		g.c.cfg.OnAcquire(l)
	}
	if noticed {
		// A Fence told this worker of the lease before the group had it:
		// look into it now.
		g.onNotice(ctx, early)
	}
}

// wrote tells the revision clock of a write of this worker's, sent after
// started and stored at rev. When that shows its samples to be of a lease
// bucket since re-created, the foreign records they dated are dated again
// when next met.
func (g *group) wrote(rev uint64, started time.Time) {
	if g.revs.wrote(rev, started) {
		clear(g.foreign)
		g.c.cfg.Logger.Warn("the lease bucket issued a revision below ones it issued before: it was re-created; dating its records afresh", "revision", rev)
	}
}

// onDrained ends a revocation: the partition is no longer held here, and
// its record may be left behind if its release failed.
func (g *group) onDrained(d drained) {
	g.drop(d.l)
	delete(g.draining, d.l.info.Partition)
	if d.stray {
		g.strays[d.l.info.Partition] = false
	}
	g.heldChanged()
}

// watchLoss forwards l's end to the loop: a loss, or a release. The loop
// drops a released lease it is not draining itself (OnAcquire's owner gave
// it up, as a worker does when a handler hangs), so that the partition can
// be taken again; the ones it drains it drops when the drain ends.
func (g *group) watchLoss(l *Lease) {
	context.AfterFunc(l.ctx, func() {
		select {
		case g.lostCh <- l:
		case <-g.done:
		}
	})
}

func (g *group) drop(l *Lease) {
	g.mu.Lock()
	if g.held[l.info.Partition] == l {
		delete(g.held, l.info.Partition)
	}
	g.mu.Unlock()
}

// revoke drains l through OnRevoke and releases it, in its own goroutine.
func (g *group) revoke(l *Lease) {
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		dctx, cancel := context.WithTimeout(l.ctx, g.c.cfg.ShutdownTimeout)
		if g.c.cfg.OnRevoke != nil {
			g.c.cfg.OnRevoke(dctx, l)
		}
		cancel()
		rctx, rcancel := context.WithTimeout(context.Background(), g.c.cfg.RequestTimeout*2)
		err := l.Release(rctx)
		stray := err != nil && !errors.Is(err, leasehold.ErrLeaseLost) && l.session != nil
		if err != nil && !errors.Is(err, leasehold.ErrLeaseLost) {
			g.c.cfg.Logger.Warn("release failed", "partition", l.info.Partition, "err", err)
		}
		rcancel()
		select {
		case g.drainCh <- drained{l: l, stray: stray}:
		case <-g.done:
		}
	}()
}

// shutdown deregisters first, so the others start rebalancing at once,
// then drains and releases every held partition.
func (g *group) shutdown(stopAdvertiser context.CancelFunc) {
	if g.stopWatch != nil {
		g.stopWatch()
	}
	if !g.c.sessions() {
		g.releaseMember()
	}
	// Let running acquisitions finish; what they take is revoked below.
	pending := len(g.acquiring)
	for pending > 0 {
		r := <-g.acqCh
		pending--
		delete(g.acquiring, r.p)
		if r.err == nil {
			g.mu.Lock()
			g.held[r.p] = r.lease
			g.mu.Unlock()
			if g.c.cfg.OnAcquire != nil {
				g.c.cfg.OnAcquire(r.lease)
			}
		}
	}
	for p, l := range g.held {
		if !g.draining[p] {
			g.draining[p] = true
			g.revoke(l)
		}
	}
	for len(g.draining) > 0 {
		select {
		case d := <-g.drainCh:
			g.drop(d.l)
			delete(g.draining, d.l.info.Partition)
			if len(g.drainCh) == 0 {
				g.flushAdvert() // free for others as soon as it is released
			}
		case <-g.lostCh:
		case <-g.watchCh:
		case <-g.strayCh:
		}
	}
	// Session-held partitions live by the registration: it goes last.
	stopAdvertiser()
	g.releaseMember()
	g.tasks.Wait()
	g.watchers.Wait()
}
