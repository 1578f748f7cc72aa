package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// Member sessions (the default; see Config.RenewPartitions) keep a worker group's partition leases
// alive through the member registration instead of through a renewal per
// partition, so that the lease bucket's write rate, and every member's
// watch traffic, grows with the number of workers, not of partitions.
//
// A session is one registration of member.<worker>: the revision of the
// write that acquired the member key names it, and every renewal of the
// registration repeats that revision in its record. A partition record
// written under a session names its holder and the session, carries no
// per-message TTL and is written only to acquire and to release: its
// epoch is still the revision of the acquiring write. It is live while
// the session is. A session ends for good when its registration expires,
// is purged or is replaced: a registration renews by compare-and-set on
// its last revision, and the marker or the new registration moved it, so
// an ended session can never be renewed again, and a new registration is a
// new session that holds nothing.
//
// So a taker may overwrite a partition record only when it is free, or
// when the session it names has ended as the stream leader tells (read
// member.<holder> through the leader: not there, a marker, or another
// session), and then only by compare-and-set on the partition record's
// revision: of two takers one wins, and a holder that re-registered and
// took the partition again moved the revision. The holder stops using its
// partitions at the session's local deadline, the send time of its last
// successful renewal plus the TTL minus the margin (I6), before the server
// can expire the registration. While it watches the partition records
// (see advert.go) it stops using one partition at once when the watch shows
// its record changed (a Fence, or a take-over); while it watches the member
// records only, a Fence tells it through a notice (notice.go), and a
// take-over by another member needs the session ended, or the record
// unlisted by its holder.

// sessions reports whether Run keeps partition leases alive by the member
// session.
func (c *Coordinator) sessions() bool { return !c.cfg.RenewPartitions }

// sessionTTLMilli is the TTL a session-held partition record names: far
// beyond any lease, and not carried as a per-message TTL. Workers that
// predate sessions treat a record without a per-message TTL as foreign and
// take it over once it has stayed unchanged for longer than the TTL it
// names, so they never take over a partition a session holds.
const sessionTTLMilli = int64(1) << 41 // about 70 years

// errMemberReleased is the cause of a session-held lease's loss when its
// member registration was released while it was still held.
var errMemberReleased = errors.New("the member registration was released")

// partitionReason is foreignReason for a partition record, which may also
// be held by a session: such a record names a session and sessionTTLMilli,
// and needs no per-message TTL.
func partitionReason(data []byte, h nats.Header) (record, string) {
	r, err := decodeRecord(data)
	if err == nil && r.Session != 0 {
		if r.TTLMilli != sessionTTLMilli {
			return r, fmt.Sprintf("the record names session %d but a TTL of %dms; a session lease names %dms", r.Session, r.TTLMilli, sessionTTLMilli)
		}
		return r, ""
	}
	return foreignReason(data, h)
}

// sessionKey names one session.
type sessionKey struct {
	holder string
	rev    uint64
}

// endedSessions remembers sessions known to have ended. An ended session
// never comes back, so what it holds is settled for good; a live one is
// always asked about again.
type endedSessions struct {
	mu sync.Mutex
	m  map[sessionKey]struct{}
}

func (s *endedSessions) has(k sessionKey) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[k]
	return ok
}

func (s *endedSessions) add(k sessionKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil || len(s.m) >= 4096 {
		s.m = map[sessionKey]struct{}{} // forgetting costs a read, never safety
	}
	s.m[k] = struct{}{}
}

// sessionLive reports whether session rev of holder is still its
// registration, as the stream leader of the lease bucket says.
func (c *Coordinator) sessionLive(ctx context.Context, holder string, rev uint64) (bool, error) {
	live, _, err := c.sessionRecord(ctx, holder, rev)
	return live, err
}

// sessionRecord is sessionLive that also returns the registration the
// leader has, when it is session rev's.
func (c *Coordinator) sessionRecord(ctx context.Context, holder string, rev uint64) (bool, record, error) {
	k := sessionKey{holder, rev}
	if c.ended.has(k) {
		return false, record{}, nil
	}
	if !validToken(holder, false) {
		return false, record{}, nil // no registration can have this name
	}
	rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	e, err := c.b.last(rctx, memberKey(holder))
	cancel()
	if err != nil {
		return false, record{}, fmt.Errorf("read the registration of %s through the leader: %w", holder, err)
	}
	if e.kind == entryValue {
		if r, foreign := foreignReason(e.data, e.header); foreign == "" && r.Holder == holder && uint64(epochOf(r, e.rev)) == rev {
			return true, r, nil
		}
	}
	c.ended.add(k)
	return false, record{}, nil
}

// lists reports whether registration r lists partition p among its
// member's holdings; a registration without a list, or with one that does
// not decode, counts as listing it: nothing shows that its member does not
// hold p.
func (c *Coordinator) lists(r record, p leasehold.Partition) bool {
	if r.Holds == nil || c.cfg.Partitions <= 0 {
		return true
	}
	holds, err := decodeHolds(*r.Holds, c.cfg.Partitions)
	if err != nil {
		return true
	}
	_, listed := slices.BinarySearch(holds, int32(p))
	return listed
}

// sessionEnded ends l, a session-held lease, because its session ended.
func (l *Lease) sessionEnded() {
	cause := context.Cause(l.session.ctx)
	reason := LostSession
	var lost *LostError
	switch {
	case errors.As(cause, &lost):
		if lost.Reason == LostDeadline {
			reason = LostDeadline
		}
	case errors.Is(cause, ErrReleased):
		cause = errMemberReleased
	}
	l.lose(reason, "", cause)
}

// sessionLive reports whether the view shows the session holding s as
// its holder's registration. It is a hint: an acquisition checks a
// session the view thinks ended through the leader.
func (g *group) sessionLive(s slot) bool {
	if s.holder == g.c.cfg.Worker {
		return false // ours and not held here: acquireKey settles it
	}
	m := g.view.members[s.holder]
	return m != nil && !m.dead() && m.session == s.session
}

// noticeRewrite ends a session-held lease this worker holds when the watch
// shows a later write on its partition record: a session-held record
// changes only when it is acquired or released, so a write that is not
// this worker's own release means another worker, or an operator's Fence,
// took the partition. A lease that renews itself learns that from its next
// renewal instead.
func (g *group) noticeRewrite(e jetstream.KeyValueEntry) {
	key := e.Key()
	if !strings.HasPrefix(key, partitionKeyPrefix) {
		return
	}
	p, err := leasehold.ParsePartition(key[len(partitionKeyPrefix):])
	if err != nil {
		return
	}
	l := g.held[p]
	// A session-held record is written once, at its epoch's revision.
	if l == nil || l.session == nil || l.releasing.Load() || e.Revision() <= uint64(l.info.Epoch) {
		return
	}
	holder := ""
	if e.Operation() == jetstream.KeyValuePut {
		if r, err := decodeRecord(e.Value()); err == nil {
			holder = r.Holder
		}
	}
	l.lose(LostRefused, holder, fmt.Errorf("the partition record was rewritten at revision %d (%s)", e.Revision(), e.Operation()))
}

// purgeOrphan removes partition p's record, written under this worker's
// session at revision rev, that this worker does not hold (its release
// failed, or an acquisition's outcome was given up on) and the assignment
// gives to another: nobody else may take it while the session lives. A
// failure is retried at a later reconciliation.
func (g *group) purgeOrphan(ctx context.Context, p leasehold.Partition, rev uint64) {
	if time.Now().Before(g.retryAt[p]) {
		return
	}
	g.retryAt[p] = time.Now().Add(g.c.cfg.RenewEvery)
	g.inBackground(ctx, g.c.cfg.RequestTimeout, func(rctx context.Context) {
		if err := g.c.b.purge(rctx, partitionKey(p), rev, g.c.b.markerTTL); err != nil && !isConflict(err) {
			g.c.cfg.Logger.Warn("could not give up a partition record this worker's session holds; retrying", "partition", p, "revision", rev, "err", err)
		}
	})
}

// inBackground runs step on a goroutine of the group's, within the bound
// on its concurrent requests (the acquisitions' too) and under a deadline
// of timeout. Its outcome is step's to report; when ctx ends before a
// request slot frees, step does not run.
func (g *group) inBackground(ctx context.Context, timeout time.Duration, step func(ctx context.Context)) {
	g.tasks.Add(1)
	go func() {
		defer g.tasks.Done()
		select {
		case g.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		defer func() { <-g.sem }()
		rctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		step(rctx)
	}()
}
