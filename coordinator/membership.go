package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// register takes this worker's member key, waiting out an earlier
// incarnation's registration under the same ID, and taking over a record
// leasehold did not write there once it has stayed unchanged for a TTL.
func (g *group) register(ctx context.Context) error {
	var (
		foreignRev   uint64
		foreignSince time.Time
		takeover     uint64
	)
	for attempt := 0; ; attempt++ {
		started := time.Now()
		l, err := g.c.acquireKey(ctx, memberTarget(g.c.cfg.Worker), acquireOpts{takeover: takeover, advertise: g.c.sessions()})
		if err == nil {
			l.startKeepalive()
			g.member = l
			g.watchLoss(l)
			g.wrote(uint64(l.info.Epoch), started)
			return nil
		}
		var (
			held    *HeldError
			foreign *ForeignRecordError
		)
		switch {
		case errors.As(err, &foreign):
			if foreign.Revision != foreignRev {
				foreignRev, foreignSince = foreign.Revision, time.Now()
				g.c.cfg.Logger.Warn("this worker's member key holds a record leasehold did not write; taking it over if it stays unchanged for a TTL",
					"worker", g.c.cfg.Worker, "revision", foreign.Revision, "reason", foreign.Reason)
			} else if time.Since(foreignSince) >= g.c.cfg.TTL {
				takeover = foreignRev
				continue
			}
		case errors.As(err, &held):
			if attempt == 0 {
				g.c.cfg.Logger.Warn("another registration under this worker ID is live; waiting for it to expire", "worker", g.c.cfg.Worker)
			}
		case attempt > 3:
			return fmt.Errorf("coordinator: register worker %s: %w", g.c.cfg.Worker, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("coordinator: register worker %s: %w", g.c.cfg.Worker, ctx.Err())
		case <-time.After(min(g.c.cfg.RenewEvery, time.Second)):
		}
	}
}

func memberTarget(worker string) target { return target{kind: kindMember, key: memberKey(worker)} }

// checkMember reads member id's record through the stream leader, once it
// has looked stale at its revision: by its headers, not by timing, so that
// a registration whose renewals this worker saw late is never dropped.
func (g *group) checkMember(ctx context.Context, id string, m *member) {
	rctx, cancel := context.WithTimeout(ctx, g.c.cfg.RequestTimeout)
	e, err := g.c.b.last(rctx, memberKey(id))
	cancel()
	if err != nil {
		return // looked at again at the next reconciliation
	}
	switch {
	case e.kind != entryValue:
		// Gone: the watch will say so.
	case e.rev != m.rev:
		m.rev, m.since, m.sum = e.rev, time.Now(), 0 // the watch is behind
	default:
		_, reason := foreignReason(e.data, e.header)
		m.checked, m.ttlless = true, reason != ""
	}
}

// warnOnce logs msg at WARN the first time it is told about revision rev
// of key, and about a later revision of the same key at most once per
// warnEvery: a record rewritten again and again (by a writer that is not
// leasehold, or one that keeps a forged record renewed) costs a line a
// minute, which says how many revisions went unlogged since the last.
func (g *group) warnOnce(key string, rev uint64, msg string, args ...any) {
	w, ok := g.warned[key]
	if ok && w.rev == rev {
		return
	}
	now := time.Now()
	if ok && now.Sub(w.at) < warnEvery {
		w.rev, w.skipped = rev, w.skipped+1
		g.warned[key] = w
		return
	}
	args = append(args, "key", key, "bucket", g.c.b.name)
	if w.skipped > 0 {
		args = append(args, "revisions_not_logged", w.skipped)
	}
	g.warned[key] = warning{rev: rev, at: now}
	g.c.cfg.Logger.Warn(msg, args...)
}

// warnEvery is how often warnOnce logs about one key.
const warnEvery = time.Minute

// warning is what warnOnce last did about a key.
type warning struct {
	rev     uint64    // the revision last told about
	at      time.Time // when a line was last logged
	skipped int       // revisions told about since, not logged
}

func (g *group) releaseMember() {
	if g.member == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), g.c.cfg.RequestTimeout*2)
	defer cancel()
	_ = g.member.Release(ctx)
	g.member = nil
}
