package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leasehold/leasehold"
)

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
		pr := priorUnknown
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
			if sess != nil {
				// Partitions held by sessions have no TTL: a free one was
				// released.
				pr = priorReleased
			}
		case s.session != 0:
			if g.sessionLive(s) {
				continue
			}
			// The view says its session ended; the acquisition checks that
			// through the leader unless it is known already.
			if s.holder == me || g.c.ended.has(sessionKey{s.holder, s.session}) {
				hint, pr = s.rev, priorLost
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
			batch = append(batch, batchItem{p: p, hint: hint, prior: pr})
			if len(batch) == g.batchSize {
				g.startBatch(ctx, batch, sess)
				batch = nil
			}
			continue
		}
		g.startOne(ctx, p, acquireOpts{takeover: takeover, session: sess, hint: hint, orphan: orphan, prior: pr})
	}
	switch {
	case len(batch) == 1:
		g.startOne(ctx, batch[0].p, acquireOpts{session: sess, hint: batch[0].hint, prior: batch[0].prior})
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
