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
// of key.
func (g *group) warnOnce(key string, rev uint64, msg string, args ...any) {
	if g.warned[key] == rev {
		return
	}
	g.warned[key] = rev
	g.c.cfg.Logger.Warn(msg, append(args, "key", key, "bucket", g.c.b.name)...)
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
