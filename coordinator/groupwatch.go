package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

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
	filters := []string{memberKeyPrefix + ">", noticeFilter(g.c.cfg.Worker)}
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
			if isNoticeTo(ev.entry.Key(), g.c.cfg.Worker) && ev.entry.Operation() == jetstream.KeyValuePut {
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
	if isNoticeTo(key, g.c.cfg.Worker) {
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
