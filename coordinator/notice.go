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
// So Fence leaves the holder a notice, notice.<holder>, naming the
// partition and the epoch it removed, that expires on its own; every
// worker watches its own. A notice is only a hint: the holder ends the
// lease only once the stream leader shows its record gone or replaced.

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
	if _, err := c.b.js.PublishMsg(rctx, &nats.Msg{Subject: c.b.prefix + noticeKey(holder), Data: data}, jetstream.WithMsgTTL(ttl)); err != nil {
		c.cfg.Logger.Warn("could not tell the holder its partition was fenced; it learns at its next progress commit", "partition", p, "holder", holder, "err", err)
	}
}

// onNotice looks into a notice to this worker: if it names a partition
// this worker holds under the session, at the epoch it holds, and the
// leader shows the record gone or another's, the lease ends.
func (g *group) onNotice(ctx context.Context, data []byte) {
	var n notice
	if err := json.Unmarshal(data, &n); err != nil || int(n.Partition) >= g.n {
		return
	}
	l := g.held[n.Partition]
	if l == nil || l.session == nil || l.releasing.Load() || l.info.Epoch != n.Epoch {
		return
	}
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		rctx, cancel := context.WithTimeout(ctx, g.c.cfg.RequestTimeout)
		defer cancel()
		e, err := g.c.b.last(rctx, l.key)
		if err != nil {
			return // its next commit settles it
		}
		if e.kind == entryValue && e.rev == uint64(l.info.Epoch) {
			return // still this lease's record: the notice is old, or not Fence's
		}
		holder := ""
		if e.kind == entryValue {
			if r, err := decodeRecord(e.data); err == nil {
				holder = r.Holder
			}
		}
		l.lose(LostRefused, holder, fmt.Errorf("the partition record of epoch %d was removed (a Fence); the stream leader's last write on it is revision %d", l.info.Epoch, e.rev))
	}()
}
