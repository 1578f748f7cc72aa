package coordinator

import (
	"context"
	"time"

	"github.com/leasehold/leasehold"
)

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
			if h := g.c.queueHook.Load(); h != nil {
				(*h)(p, len(members))
			}
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
