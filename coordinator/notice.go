package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// A worker that watches the member records only does not see a Fence
// remove one of its session-held partition records, and would hold the
// partition in its own eyes, and in its list, until its next progress
// commit was refused: an idle partition would stay free and unassigned.
// So Fence leaves the holder a notice, notice.<holder>.<partition>, naming
// the partition and the epoch it removed, that expires on its own; every
// worker watches its own. So does an acquisition that overwrites a live
// session's record as unlisted (advert.go): its holder may hold it after
// all. One key a partition: of several notices that land together on one
// key, the holder's watch may show only the last. A notice is only a hint:
// the holder ends the lease only once the stream leader shows its record
// gone or replaced.

// notice is what Fence tells a holder.
type notice struct {
	Partition leasehold.Partition `json:"partition"`
	Epoch     leasehold.Epoch     `json:"epoch"`
}

// notify leaves holder a notice that its lease on p at epoch was
// removed. A notice that cannot be written costs the holder time, not
// safety: its next progress commit is refused.
func (c *Coordinator) notify(ctx context.Context, holder string, p leasehold.Partition, epoch leasehold.Epoch) {
	if !validToken(holder, false) {
		return
	}
	data, err := json.Marshal(notice{Partition: p, Epoch: epoch})
	if err != nil {
		return
	}
	ttl := max(c.cfg.TTL, c.b.markerTTL, time.Second).Round(time.Second)
	rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	if _, err := c.b.js.PublishMsg(rctx, &nats.Msg{Subject: c.b.prefix + noticeKey(holder, p), Data: data}, jetstream.WithMsgTTL(ttl)); err != nil {
		c.cfg.Logger.Warn("could not tell the holder its partition was fenced; it learns at its next progress commit", "partition", p, "holder", holder, "err", err)
	}
}

// onNotice looks into a notice to this worker: if it names a partition
// this worker holds under the session, at the epoch it holds, and the
// leader shows the record gone or another's, the lease ends.
//
// Anyone who can write to the bucket can write notices, so they cost a
// bounded amount: one leader read in flight per lease, however many
// notices name it. A notice that comes during a read gets one more read
// after it, as that read may have begun before the Fence the notice
// reports; a flood of notices during one read gets one more read, not
// one each.
func (g *group) onNotice(ctx context.Context, data []byte) {
	var n notice
	if err := json.Unmarshal(data, &n); err != nil || int(n.Partition) >= g.n {
		return
	}
	l := g.held[n.Partition]
	if l == nil && g.acquiring[n.Partition] {
		// It may name the lease being handed out (a Fence that came
		// between the fence step and the group, which for a batch is the
		// whole batch): looked into once the acquisition is in.
		g.early[n.Partition] = data
		return
	}
	if l == nil || l.session == nil || l.releasing.Load() || l.info.Epoch != n.Epoch {
		return
	}
	g.c.hookNotice("notice", data)
	if l.notices.Add(1) > 1 {
		return // the read in flight reads once more
	}
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		for g.checkNotice(ctx, l) {
			// Notices came during the read: once more, for all of them.
		}
	}()
}

func (c *Coordinator) hookNotice(event string, data []byte) {
	if h := c.noticeHook.Load(); h != nil {
		(*h)(event, data)
	}
}

// checkNotice asks the stream leader whether l's record is still its own
// and ends l if not. It reports whether to read again: notices came
// during this read.
func (g *group) checkNotice(ctx context.Context, l *Lease) (again bool) {
	if g.readNotice(ctx, l) {
		return false // lost: nothing more to read
	}
	for {
		switch c := l.notices.Load(); {
		case c <= 1:
			if l.notices.CompareAndSwap(c, 0) {
				g.c.hookNotice("idle", nil)
				return false
			}
		case l.notices.CompareAndSwap(c, 1):
			return true
		}
	}
}

// readNotice is one leader read for a notice; it reports whether l ended.
func (g *group) readNotice(ctx context.Context, l *Lease) (ended bool) {
	g.c.hookNotice("read", nil)
	rctx, cancel := context.WithTimeout(ctx, g.c.cfg.RequestTimeout)
	defer cancel()
	e, err := g.c.b.last(rctx, l.key)
	if err != nil {
		return false // its next commit settles it
	}
	if e.kind == entryValue && e.rev == uint64(l.info.Epoch) {
		return false // still this lease's record: the notice is old, or not Fence's
	}
	holder := ""
	if e.kind == entryValue {
		if r, err := decodeRecord(e.data); err == nil {
			holder = r.Holder
		}
	}
	l.lose(LostRefused, holder, fmt.Errorf("the partition record of epoch %d was removed (a Fence); the stream leader's last write on it is revision %d", l.info.Epoch, e.rev))
	return true
}
