package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/leasehold/leasehold"
)

// Members that list their holdings in their registrations (see
// encodeHolds) let each other watch the member records alone. A worker
// watches the partition records too while it must: it renews partitions
// itself (Config.RenewPartitions), or a live member does not list what it
// holds (an earlier version, during a rolling upgrade, or a list that does
// not decode), and so every member, old or new, computes the assignment
// from the same facts.

// bulkQueue is how many acquisitions must wait for this worker's list to
// be written at most once a second.
const bulkQueue = 512

// advert is a list of holdings to write to a registration; with unlisted,
// the registration is to list none (see listFits).
type advert struct {
	member   *Lease
	holds    string
	unlisted bool
}

// strayResult is the outcome of a look at a partition record this
// worker's session may have left behind.
type strayResult struct {
	p   leasehold.Partition
	err error
}

// heldSeen is what an acquisition found holding a partition: a record of
// holder's session, at revision rev, first found at since.
type heldSeen struct {
	holder string
	rev    uint64
	since  time.Time
}

// foreignSeen is when an acquisition first found a partition record
// leasehold did not write, at that revision.
type foreignSeen struct {
	rev   uint64
	since time.Time
}

// wantPartitions reports whether the facts in v are complete only with the
// partition records.
func (g *group) wantPartitions(v *view) bool {
	if !g.c.sessions() || g.selfUnlisted {
		return true
	}
	for id, m := range v.members {
		if id == g.c.cfg.Worker || m.dead() {
			continue
		}
		if !m.adverts {
			if m.badHolds != "" {
				g.warnOnce(memberKey(id), m.rev, "a member record lists holdings that do not decode: watching every partition record until it stops",
					"worker", id, "reason", m.badHolds)
			}
			return true
		}
	}
	return false
}

// checkMode starts the watchers anew when the partition records are needed
// and not watched, or watched and no longer needed.
func (g *group) checkMode(ctx context.Context) {
	if g.next != nil {
		return // a snapshot is being read; checked again once it is in
	}
	want := g.wantPartitions(g.view)
	if want == g.watchParts {
		return
	}
	g.watchParts = want
	if want {
		g.c.cfg.Logger.Info("a member does not list its holdings: watching the partition records too")
	} else {
		g.c.cfg.Logger.Info("every member lists its holdings: watching the member records only")
	}
	if err := g.watch(ctx); err != nil {
		g.c.cfg.Logger.Warn("restart of the lease bucket watch failed; retrying at the next rescan", "err", err)
	}
}

// listed folds the members' lists into owners, for a view without the
// partition records: a partition two members list (one released it, the
// other took it, and the first one's new list is not in yet) goes to the
// one whose name sorts first, on every worker alike.
func (g *group) listed(owners []string, members []string) {
	me := g.c.cfg.Worker
	for _, id := range members {
		m := g.view.members[id]
		if id == me || m == nil {
			continue
		}
		for _, p := range m.holds {
			if owners[p] == "" || id < owners[p] {
				owners[p] = id
			}
		}
	}
}

// listChanged lets the acquisitions that found a partition held by member
// id try again: its list, or its membership, changed.
func (g *group) listChanged(id string) {
	for p, h := range g.heldBy {
		if h.holder == id {
			delete(g.retryAt, p)
		}
	}
}

// listLag bounds how long a partition a member holds can stay off its
// list: its acquisition ends within a TTL (the fence step included), its
// list is written at most a second after that, and the write takes up to a
// request timeout; a lease-long margin on top, as for a stale record.
func (g *group) listLag() time.Duration {
	return staleAfter(0, g.c.cfg.TTL) + time.Second + g.c.cfg.RequestTimeout
}

// unlisted returns the revision of partition p's record when an
// acquisition has found it held by a live session whose member has not
// listed it since, for longer than a list can lag (listLag):
// the member does not hold it, and has not removed it (a release whose
// failure it did not see). An acquisition may then overwrite exactly that
// revision, if the holder's registration as the stream leader has it does
// not list the partition either (this view may be behind), and it tells
// the holder (notice.go): a list can lag for longer still, under load, and
// the holder may hold the partition after all. It returns 0 otherwise.
func (g *group) unlisted(p leasehold.Partition, now time.Time) uint64 {
	h, ok := g.heldBy[p]
	if !ok || now.Sub(h.since) <= g.listLag() {
		return 0
	}
	m := g.view.members[h.holder]
	if m == nil || m.dead() || !m.adverts || m.rev <= h.rev {
		return 0
	}
	if _, listed := slices.BinarySearch(m.holds, int32(p)); listed {
		return 0
	}
	g.warnOnce(partitionKey(p), h.rev, "partition record of a live session its holder does not list: taking the partition over",
		"partition", p, "revision", h.rev, "holder", h.holder, "unlisted_for", now.Sub(h.since).Round(time.Millisecond))
	return h.rev
}

// listMoved takes in a change of member id's list, from before to after,
// without computing the assignment again when the change is one the last
// assignment foresaw: the member took partitions it was given, or gave up
// ones it was not. Keeping a partition one was given, or giving up one one
// was not, leaves the assignment as it was while the shares do not depend
// on the holdings (the partitions divide evenly among the members). A
// partition given up that the assignment gives this worker is queued at
// once. It reports whether the assignment must be computed again.
func (g *group) listMoved(ctx context.Context, id string, before, after []int32) bool {
	if g.assigner == nil || len(g.target) != g.n || g.mine < 0 {
		return true
	}
	i := g.assigner.indexOf(id)
	if i < 0 || !g.evenShares() {
		return true
	}
	queued := false
	for x, y := 0, 0; x < len(before) || y < len(after); {
		switch {
		case y == len(after) || (x < len(before) && before[x] < after[y]):
			p := before[x] // given up
			x++
			switch g.target[p] {
			case i:
				return true
			case g.mine:
				g.queue = append(g.queue, leasehold.Partition(p))
				queued = true
			}
		case x == len(before) || after[y] < before[x]:
			p := after[y] // taken
			y++
			if g.target[p] != i {
				return true
			}
		default:
			x, y = x+1, y+1
		}
	}
	if queued {
		g.startQueued(ctx, time.Now())
	}
	return false
}

// evenShares reports whether the partitions divide evenly among the
// members of the last assignment, whose shares then do not depend on who
// holds what.
func (g *group) evenShares() bool {
	if g.assigner == nil {
		return false
	}
	k := len(g.assigner.members)
	return k > 0 && g.n%k == 0
}

// heldChanged schedules this worker's list of holdings to be written:
// changes that come together are written together. While hundreds of
// acquisitions wait (a cold start of thousands of partitions) the list is
// written at most every second: every member decodes every list written,
// at 65,536 partitions over 64 members that was a third of a cold start's
// CPU, and the lists of partitions being taken matter less than those of
// partitions given up. A smaller group writes within the settle pause, as
// the others' shares depend on what it holds.
func (g *group) heldChanged() {
	if !g.c.sessions() || g.advDue {
		return
	}
	g.advDue = true
	pause := settlePause(g.n)
	if len(g.queue) >= bulkQueue {
		pause = max(pause, time.Second)
	}
	g.advTimer.Reset(pause)
}

// flushAdvert hands this worker's holdings to the advertiser when they
// differ from what its registration lists.
func (g *group) flushAdvert() {
	g.advDue = false
	if !g.c.sessions() || g.member == nil {
		return
	}
	g.mu.Lock()
	list := heldList(g.held)
	g.mu.Unlock()
	if h := g.c.listHook.Load(); h != nil {
		list = (*h)(list)
	}
	holds := encodeHolds(list)
	if g.advMember == g.member && g.advHolds == holds {
		return
	}
	g.advMember, g.advHolds = g.member, holds
	unlisted := !g.c.listFits(holds)
	if unlisted && !g.selfUnlisted {
		g.c.cfg.Logger.Warn("this worker's list of holdings does not fit in a message the server takes: listing none, and every member watches the partition records",
			"worker", g.c.cfg.Worker, "partitions", len(g.held), "list_bytes", len(holds))
	}
	g.selfUnlisted = unlisted
	select {
	case <-g.advCh: // replaced by the newer list
	default:
	}
	g.advCh <- advert{member: g.member, holds: holds, unlisted: unlisted}
}

// listFits reports whether a registration listing holds fits, with its
// headers, in a message the server takes: a registration is renewed with
// its list, and one refused for its size lapses with every partition its
// member holds. At the default max payload (1 MiB) every list of up to
// 65,536 partitions fits; a server configured with less may not take one.
func (c *Coordinator) listFits(holds string) bool {
	limit := int64(1 << 20)
	if nc := c.b.js.Conn(); nc != nil {
		limit = nc.MaxPayload()
	}
	const headroom = 1024 // the rest of the record, the subject and the headers
	return int64(len(holds))+headroom <= limit
}

// advertiser writes the lists flushAdvert hands it, the newest first: a
// write that fails without an answer is tried again, with a backoff, until
// it lands, a newer list replaces it, or the registration ends (its
// renewals fail the same way, and the registration's deadline bounds them).
func (g *group) advertiser(ctx context.Context) {
	for {
		var a advert
		select {
		case a = <-g.advCh:
		case <-ctx.Done():
			return
		}
		for attempt := 0; ; attempt++ {
			err := a.member.advertise(ctx, a.holds, a.unlisted)
			if err == nil || a.member.Err() != nil || ctx.Err() != nil ||
				errors.Is(err, leasehold.ErrLeaseLost) || errors.Is(err, ErrReleased) {
				break
			}
			g.c.cfg.Logger.Debug("writing this worker's holdings to its registration failed; retrying", "err", err)
			select {
			case a = <-g.advCh:
				attempt = 0
			case <-time.After(backoff(attempt)):
			case <-ctx.Done():
				return
			}
		}
	}
}

// checkStray removes partition p's record if this worker's current session
// wrote it and the worker does not hold it (an acquisition whose outcome
// was given up on, or a release that failed): nobody else may take it
// while the session lives, and without the partition records this worker
// sees it nowhere else.
func (g *group) checkStray(ctx context.Context, p leasehold.Partition) {
	if g.strays[p] || time.Now().Before(g.retryAt[p]) || g.member == nil {
		return
	}
	// No acquisition of p starts while the look runs: it reads the record
	// afresh, and must not purge one this worker just took.
	g.strays[p] = true
	g.retryAt[p] = time.Now().Add(g.c.cfg.RenewEvery)
	session := uint64(g.member.info.Epoch)
	g.inBackground(ctx, 2*g.c.cfg.RequestTimeout, func(rctx context.Context) {
		err := g.c.purgeStray(rctx, p, session)
		select {
		case g.strayCh <- strayResult{p: p, err: err}:
		case <-ctx.Done():
		}
	})
}

// purgeStray removes partition p's record if session of this worker wrote
// it; any other record, or none, is left alone.
func (c *Coordinator) purgeStray(ctx context.Context, p leasehold.Partition, session uint64) error {
	e, err := c.b.last(ctx, partitionKey(p))
	if err != nil {
		return fmt.Errorf("read partition %d's record through the leader: %w", p, err)
	}
	if e.kind != entryValue {
		return nil
	}
	r, err := decodeRecord(e.data)
	if err != nil || r.Holder != c.cfg.Worker || r.Session != session {
		return nil
	}
	if err := c.b.purge(ctx, partitionKey(p), e.rev, c.b.markerTTL); err != nil && !isConflict(err) {
		return fmt.Errorf("remove partition %d's record (revision %d): %w", p, e.rev, err)
	}
	return nil
}

// onStray settles a look checkStray started.
func (g *group) onStray(r strayResult) {
	if r.err == nil {
		delete(g.strays, r.p)
		return
	}
	g.strays[r.p] = false
	g.c.cfg.Logger.Warn("could not give up a partition record this worker's session holds; retrying", "partition", r.p, "err", r.err)
}
