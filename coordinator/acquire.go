package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold"
)

// ErrHeld is matched by the error Acquire returns when another lease on the
// partition is live.
var ErrHeld = errors.New("coordinator: partition is held by another lease")

// HeldError reports the live lease that stopped an acquisition.
type HeldError struct {
	Lease leasehold.Lease // the live lease, as far as its record tells
	Lock  string          // the lock's name, for a lock
}

func (e *HeldError) Error() string {
	what := fmt.Sprintf("partition %d", e.Lease.Partition)
	if e.Lock != "" {
		what = fmt.Sprintf("lock %q", e.Lock)
	}
	return fmt.Sprintf("coordinator: %s is held by %s at epoch %d: wait for its release or expiry",
		what, e.Lease.Holder, e.Lease.Epoch)
}

// Is makes errors.Is(err, ErrHeld) true.
func (e *HeldError) Is(target error) bool { return target == ErrHeld }

// ErrForeignRecord is matched by errors about a lease key that holds a
// record leasehold did not write.
var ErrForeignRecord = errors.New("coordinator: the lease key holds a record leasehold did not write")

// ForeignRecordError reports a lease key (a partition, lock or member key)
// whose value is not a lease: it does not decode, or carries no per-message
// TTL, so the server would never expire it. Acquire does not overwrite it;
// Fence does, and a worker group takes it over once it has stayed
// unchanged for a TTL.
type ForeignRecordError struct {
	Bucket   string
	Key      string
	Revision uint64
	Reason   string
}

func (e *ForeignRecordError) Error() string {
	return fmt.Sprintf("coordinator: %s of lease bucket %s (revision %d) is not a lease leasehold wrote: %s; %s",
		e.Key, e.Bucket, e.Revision, e.Reason, repairHint(e.Key))
}

// Is makes errors.Is(err, ErrForeignRecord) true.
func (e *ForeignRecordError) Is(target error) bool { return target == ErrForeignRecord }

// Coordinator is one worker's access to the lease bucket: it acquires
// leases on partitions and locks under the worker's ID and, through Run,
// balances partitions with the other live workers.
type Coordinator struct {
	b   *Bucket
	cfg Config

	mu    sync.Mutex
	group *group // set while Run runs

	ended endedSessions

	// batches counts the atomic batches of partition records and of fence
	// records that landed (batch.go), for tests.
	batches, fenceBatches atomic.Int64

	// noticeHook, set by tests only, is called with "notice" and the
	// notice for each notice that names a lease this worker holds at its
	// epoch, with "read" before each leader read for them, and with
	// "idle" when a lease's reads end with no notice left to read for.
	noticeHook atomic.Pointer[func(event string, data []byte)]

	// queueHook, set by tests only, is called with each partition a
	// reconciliation queues for this worker to take, and the number of
	// members (this worker among them) its view held then.
	queueHook atomic.Pointer[func(p leasehold.Partition, members int)]

	// listHook, set by tests only, changes the list of holdings this
	// worker's registration is to list: a list that lags behind what the
	// worker holds.
	listHook atomic.Pointer[func(held []leasehold.Partition) []leasehold.Partition]
}

// New returns a Coordinator for the worker cfg describes.
func New(b *Bucket, cfg Config) (*Coordinator, error) {
	if b == nil {
		return nil, errors.New("coordinator: New needs a lease bucket (coordinator.Provision or OpenBucket)")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("coordinator: invalid config: %w", err)
	}
	cfg.setDefaults()
	return &Coordinator{b: b, cfg: cfg}, nil
}

// Worker is this coordinator's worker ID.
func (c *Coordinator) Worker() string { return c.cfg.Worker }

// Config returns the configuration with defaults filled in.
func (c *Coordinator) Config() Config { return c.cfg }

// Bucket is the lease bucket.
func (c *Coordinator) Bucket() *Bucket { return c.b }

// AcquireOption adjusts one Acquire or Lock call.
type AcquireOption func(*acquireOpts)

type acquireOpts struct {
	manual bool
	// takeover is the revision of a foreign record the acquisition may
	// overwrite.
	takeover uint64
	// repair lets the fence step rewrite a fence record that does not
	// decode or claims an epoch the lease bucket never issued.
	repair bool
	// session, when set, is the member registration the lease is to live
	// by (Run's default): the record names it and carries no TTL.
	session *Lease
	// hint is the revision the first write expects: a marker's, or a
	// record's whose session the worker knows has ended. The write is a
	// compare-and-set, so a wrong hint costs a read, not safety.
	hint uint64
	// advertise makes a member registration list the partitions its member
	// holds (empty at first): see encodeHolds.
	advertise bool
	// orphan is the revision of a partition record a live session wrote
	// whose holder has not listed it for longer than a lease could go
	// unlisted (see advert.go): the acquisition may overwrite exactly it.
	orphan uint64
	// prior is what the key holds at hint, when the caller knows: a
	// release's marker, or the record of a holder whose lease is over.
	prior prior
	// prepared is the record to write: one an atomic batch tried to write
	// with an outcome not known (see batch.go), so that finding it stored
	// settles the acquisition.
	prepared *record
}

// ManualRenew leaves renewal to the caller: the lease does not renew
// itself, and is lost at its local deadline unless Renew is called.
func ManualRenew() AcquireOption { return func(o *acquireOpts) { o.manual = true } }

func optionsOf(opts []AcquireOption) acquireOpts {
	var o acquireOpts
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// leaseKind says what a lease is on.
type leaseKind int

const (
	kindPartition leaseKind = iota
	kindMember
	kindLock
)

// target is what an acquisition is for.
type target struct {
	kind leaseKind
	key  string
	p    leasehold.Partition
	name string // the lock's name
}

func partitionTarget(p leasehold.Partition) target {
	return target{kind: kindPartition, key: partitionKey(p), p: p}
}

func (t target) String() string {
	switch t.kind {
	case kindLock:
		return fmt.Sprintf("lock %q", t.name)
	case kindMember:
		return "membership"
	}
	return "partition " + t.p.String()
}

// Acquire takes partition p if no other lease on it is live, and fences
// it: the fence record is rewritten under the new epoch and acquisition
// before the lease is returned, so that no earlier holder can commit
// progress any more. It returns a *HeldError (matching ErrHeld) when
// another lease is live, and a *ForeignRecordError when the key holds a
// record leasehold did not write.
func (c *Coordinator) Acquire(ctx context.Context, p leasehold.Partition, opts ...AcquireOption) (*Lease, error) {
	return c.acquire(ctx, partitionTarget(p), optionsOf(opts))
}

// acquire takes the lease key of t, then fences t's record, then hands the
// lease out.
func (c *Coordinator) acquire(ctx context.Context, t target, o acquireOpts) (*Lease, error) {
	l, err := c.acquireKey(ctx, t, o)
	if err != nil {
		return nil, err
	}
	l, err = c.handOut(ctx, l, t, o, l.fence(ctx, o.repair))
	if err == nil && l.displaced.Holder != "" {
		// The holder of the unlisted record may hold it after all (its
		// list lagged behind, or this worker's view of it did): its
		// session is live, and it does not watch the partition records.
		// Tell it, as a Fence does, now that the fence step has landed.
		c.notify(context.WithoutCancel(ctx), l.displaced.Holder, t.p, l.displaced.Epoch)
	}
	return l, err
}

// handOut ends an acquisition whose lease key l holds once its fence step
// has returned ferr: it releases the lease if the fence failed, and
// otherwise reports the acquisition and starts the lease's renewals.
func (c *Coordinator) handOut(ctx context.Context, l *Lease, t target, o acquireOpts, ferr error) (*Lease, error) {
	if ferr != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
		defer cancel()
		if !errors.Is(ferr, leasehold.ErrLeaseLost) {
			_ = l.Release(rctx)
		}
		return nil, fmt.Errorf("coordinator: acquire %s: fence: %w", t, ferr)
	}
	c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventAcquired, Lease: l.info, Lock: l.name, Time: time.Now()})
	l.logAcquired()
	if !o.manual && l.session == nil {
		l.startKeepalive()
	}
	return l, nil
}

func (l *Lease) startKeepalive() {
	l.stopped = make(chan struct{})
	go l.keepalive()
}

// acquireKey writes a fresh lease record to t's key if the key holds no
// live record (or holds the foreign record at revision o.takeover). Each
// attempt that gets no answer is settled by reading the key from the stream
// leader: the record's token tells whether the write landed. With
// o.session, the record is held by that session, and a partition record
// whose session has ended counts as free.
func (c *Coordinator) acquireKey(ctx context.Context, t target, o acquireOpts) (*Lease, error) {
	takeover, sess := o.takeover, o.session
	rec := c.newRecord(sess)
	ttl := c.cfg.TTL
	if sess != nil {
		ttl = 0
	}
	if o.prepared != nil {
		rec = *o.prepared
	}
	if o.advertise && t.kind == kindMember {
		rec.Holds = new("")
	}
	value, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	var (
		expect    = o.hint // takeover is written over only once read and checked
		firstSent time.Time
		lastErr   error
		transient bool // the last attempt failed without an answer: back off
		// pr is what the key holds at expect: how its last holder let go.
		pr = o.prior
		// displaced is the lease of a live session whose record, at
		// expect, is overwritten as unlisted (o.orphan).
		displaced leasehold.Lease
	)
	if expect == 0 {
		pr = priorFree
	}
	for attempt := 0; attempt < 8; attempt++ {
		if transient {
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("coordinator: acquire %s: %w (last error: %v)", t, ctx.Err(), lastErr)
			case <-time.After(backoff(attempt)):
			}
		}
		if sess != nil {
			if err := sess.Err(); err != nil {
				return nil, fmt.Errorf("coordinator: acquire %s: the member registration ended: %w", t, err)
			}
		}
		sent := time.Now()
		if firstSent.IsZero() {
			firstSent = sent
		}
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
		rev, err := c.b.put(rctx, t.key, value, expect, ttl)
		cancel()
		if err == nil {
			l := c.newLease(t, rec, rev, sent, sess)
			l.prior = pr
			if displaced.Holder != "" && expect == uint64(displaced.Epoch) {
				l.displaced = displaced
			}
			return l, nil
		}
		lastErr = err
		if isRefusal(err) && !isConflict(err) {
			return nil, fmt.Errorf("coordinator: acquire %s: %w", t, err)
		}
		// No answer, or a write to the key still in flight (which the key
		// read back does not show yet): back off before the next attempt.
		transient = !isRefusal(err) || isInFlight(err)
		// The key holds something, or the outcome is unknown: read it.
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
		e, rerr := c.b.last(rctx, t.key)
		cancel()
		if rerr != nil {
			lastErr = fmt.Errorf("%w (reading the key back: %v)", err, rerr)
			transient = true
			continue
		}
		switch e.kind {
		case entryNone:
			expect, pr = 0, priorFree
		case entryMarker:
			expect, pr = e.rev, markerPrior(e.header)
		case entryValue:
			r, foreign := foreignReason(e.data, e.header)
			if t.kind == kindPartition {
				r, foreign = partitionReason(e.data, e.header)
			}
			if foreign == "" && r.Token == rec.Token {
				// An earlier attempt landed. Count the lease from the first
				// send, the earliest it can have been stored.
				l := c.newLease(t, rec, e.rev, firstSent, sess)
				l.prior = pr
				l.displaced = displaced // a hint: the holder reads its record through the leader
				if ctx.Err() != nil {
					_ = l.Release(context.WithoutCancel(ctx))
					return nil, fmt.Errorf("coordinator: acquire %s: %w", t, ctx.Err())
				}
				return l, nil
			}
			if foreign != "" {
				if e.rev == takeover {
					expect, pr = e.rev, priorLost
					continue
				}
				return nil, &ForeignRecordError{Bucket: c.b.name, Key: t.key, Revision: e.rev, Reason: foreign}
			}
			if r.Session != 0 {
				if sess != nil && r.Holder == rec.Holder && r.Session == rec.Session {
					// Written under this very session, yet not held: an
					// acquisition whose outcome was given up on, or a
					// release that failed. Nobody else can hold it.
					expect, pr = e.rev, priorUnknown
					continue
				}
				rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
				live, reg, lerr := c.sessionRecord(rctx, r.Holder, r.Session)
				cancel()
				if lerr != nil {
					lastErr = fmt.Errorf("%w (%v)", err, lerr)
					transient = true
					continue
				}
				// An unlisted record is overwritten only if the holder's
				// registration, as the leader has it, does not list it
				// either: this worker's view of that list may be behind.
				if !live || (o.orphan != 0 && e.rev == o.orphan && t.kind == kindPartition && !c.lists(reg, t.p)) {
					// Its session has ended for good, or its holder does
					// not hold it: the partition is free, at exactly this
					// revision.
					expect, pr = e.rev, priorLost
					if live {
						displaced = c.b.leaseOf(t, r, e.rev)
					}
					continue
				}
			}
			return nil, &HeldError{Lease: c.b.leaseOf(t, r, e.rev), Lock: t.name}
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("coordinator: acquire %s: %w", t, ctx.Err())
		}
	}
	// The key changed hands between every read and write: others are
	// acquiring and releasing it as fast as this worker can look.
	return nil, fmt.Errorf("%w: %s changed hands %d times while this worker tried to take it (last refusal: %v)", ErrHeld, t, 8, lastErr)
}

// newRecord is the record of a new acquisition of this worker's, held by
// sess when it is set.
func (c *Coordinator) newRecord(sess *Lease) record {
	rec := record{
		Holder:   c.cfg.Worker,
		Token:    newToken(),
		TTLMilli: c.cfg.TTL.Milliseconds(),
		Acquired: time.Now().UTC(),
	}
	if sess != nil {
		rec.Session, rec.TTLMilli = uint64(sess.info.Epoch), sessionTTLMilli
	}
	return rec
}

// leaseOf describes the lease whose record r is the value of t's key at
// revision rev.
func (b *Bucket) leaseOf(t target, r record, rev uint64) leasehold.Lease {
	l := leasehold.Lease{Scope: b.scope, Partition: t.p, Epoch: epochOf(r, rev), Acquisition: r.Token, Holder: r.Holder, Acquired: r.Acquired}
	if t.kind == kindLock {
		l.Scope, l.Partition = leasehold.LockScope(b.scope, t.name), 0
	}
	return l
}

func backoff(attempt int) time.Duration {
	d := 10 * time.Millisecond << min(attempt, 6)
	return d/2 + time.Duration(int64(d/2)*int64(time.Now().UnixNano()%1000)/1000)
}
