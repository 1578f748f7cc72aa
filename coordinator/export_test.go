package coordinator

import (
	"context"
	"encoding/json"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// SetWallClock makes Provision read f instead of the real clock, until the
// returned function is called.
func SetWallClock(f func() time.Time) (restore func()) {
	old := wallClock
	wallClock = f
	return func() { wallClock = old }
}

// Lock key encoding, for its tests.
var (
	EncodeLockName = encodeLockName
	DecodeLockName = decodeLockName
)

// RegisterSession registers c's member key without renewing it: a session
// for AcquireInSession, renewed by the test (Renew, KeepRenewing) or left
// to expire.
func (c *Coordinator) RegisterSession(ctx context.Context) (*Lease, error) {
	return c.acquireKey(ctx, memberTarget(c.cfg.Worker), acquireOpts{})
}

// KeepRenewing starts l's keepalive.
func (l *Lease) KeepRenewing() { l.startKeepalive() }

// AcquireInSession acquires partition p held by session, as Run does with
// member sessions, the default.
func (c *Coordinator) AcquireInSession(ctx context.Context, p leasehold.Partition, session *Lease) (*Lease, error) {
	return c.acquire(ctx, partitionTarget(p), acquireOpts{session: session})
}

// Freeze stops l's local deadline, as if the process had been paused
// before it could fire: its holder keeps believing it holds.
func (l *Lease) Freeze() {
	l.dmu.Lock()
	defer l.dmu.Unlock()
	l.timer.Stop()
}

// DecodeHolds decodes a member record's list of holdings, for its tests.
var DecodeHolds = decodeHolds

// RegisterListingSession is RegisterSession for a registration that lists
// its member's holdings, as Run's do: it lists none.
func (c *Coordinator) RegisterListingSession(ctx context.Context) (*Lease, error) {
	return c.acquireKey(ctx, memberTarget(c.cfg.Worker), acquireOpts{advertise: true})
}

// SetNoticeHook has f called with "notice" and the notice for each notice
// naming a lease c holds at its epoch, with "read" before each leader read
// for them, and with "idle" when a lease's reads end with none pending.
func (c *Coordinator) SetNoticeHook(f func(event string, data []byte)) { c.noticeHook.Store(&f) }

// SetQueueHook has f called with each partition a reconciliation of c
// queues to take, and how many members (c's worker among them) c's view of
// the group held then. The latest call for a partition before c acquires
// it tells the view it was taken on.
func (c *Coordinator) SetQueueHook(f func(p leasehold.Partition, members int)) { c.queueHook.Store(&f) }

// Advertise makes l, a listing registration, list ps and writes it.
func (l *Lease) Advertise(ctx context.Context, ps []leasehold.Partition) error {
	return l.advertise(ctx, encodeHolds(ps), false)
}

// AcquireUnlisted acquires partition p held by session, as Run does once
// its view says the live session that wrote p's record at rev does not
// list it (acquireOpts.orphan).
func (c *Coordinator) AcquireUnlisted(ctx context.Context, p leasehold.Partition, session *Lease, rev uint64) (*Lease, error) {
	return c.acquire(ctx, partitionTarget(p), acquireOpts{session: session, orphan: rev})
}

// SetListHook has f choose the list of holdings c's registration lists,
// from what c holds: a list that lags behind its holdings.
func (c *Coordinator) SetListHook(f func(held []leasehold.Partition) []leasehold.Partition) {
	c.listHook.Store(&f)
}

// RewriteUnseen publishes l's record again over its current revision, on
// l's own connection and without waiting for the answer: a renewal whose
// answer was never read (its request was cancelled, or timed out) and
// that the server may still be storing when l's next write arrives.
func (l *Lease) RewriteUnseen() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	msg := nats.NewMsg(l.c.b.prefix + l.key)
	msg.Data = l.value
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(l.rev, 10))
	if l.session == nil {
		msg.Header.Set(jetstream.MsgTTLHeader, l.c.cfg.TTL.String())
	}
	return l.c.b.js.Conn().PublishMsg(msg)
}

// CommitUnseen publishes l's fence record with progress seq over its
// current revision, on l's own connection and without waiting for the
// answer: a commit whose answer was never read, still being stored when
// l's next commit arrives.
func (l *Lease) CommitUnseen(seq uint64) error {
	l.pmu.Lock()
	defer l.pmu.Unlock()
	next := l.fenced
	next.Seq = seq
	value, err := json.Marshal(next)
	if err != nil {
		return err
	}
	msg := nats.NewMsg(l.c.b.fencePrefix + l.key)
	msg.Data = value
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(l.fenceRev, 10))
	return l.c.b.js.Conn().PublishMsg(msg)
}

// AcquireBatch acquires ps under session in one atomic batch, as Run does
// once membership has settled, with each record expected empty. It returns
// each partition's lease or error, in order.
func (c *Coordinator) AcquireBatch(ctx context.Context, ps []leasehold.Partition, session *Lease) ([]*Lease, []error) {
	items := make([]batchItem, len(ps))
	for i, p := range ps {
		items[i] = batchItem{p: p}
	}
	rs := c.acquireBatch(ctx, items, session, &acqBatch{size: len(ps), left: len(ps)})
	leases, errs := make([]*Lease, len(rs)), make([]error, len(rs))
	for i, r := range rs {
		leases[i], errs[i] = r.lease, r.err
	}
	return leases, errs
}

// Batches is how many atomic batches of partition records and of fence
// records c wrote.
func (c *Coordinator) Batches() (records, fences int64) {
	return c.batches.Load(), c.fenceBatches.Load()
}
