package coordinator

import (
	"context"
	"errors"

	"github.com/leasehold/leasehold"
)

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
