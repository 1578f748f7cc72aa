package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/leasehold/leasehold"
)

// ErrHeld is matched by the error Acquire returns when another lease on the
// partition is live.
var ErrHeld = errors.New("coordinator: partition is held by another lease")

// HeldError reports the live lease that stopped an acquisition.
type HeldError struct {
	Lease leasehold.Lease // the live lease, as far as its record tells
}

func (e *HeldError) Error() string {
	return fmt.Sprintf("coordinator: partition %d is held by %s at epoch %d: wait for its release or expiry",
		e.Lease.Partition, e.Lease.Holder, e.Lease.Epoch)
}

// Is makes errors.Is(err, ErrHeld) true.
func (e *HeldError) Is(target error) bool { return target == ErrHeld }

// Coordinator is one worker's access to the lease bucket: it acquires
// leases under the worker's ID and, through Run, balances partitions with
// the other live workers.
type Coordinator struct {
	b   *Bucket
	cfg Config

	mu    sync.Mutex
	group *group // set while Run runs

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

// AcquireOption adjusts one Acquire call.
type AcquireOption func(*acquireOpts)

type acquireOpts struct{ manual bool }

// ManualRenew leaves renewal to the caller: the lease does not renew
// itself, and is lost at its local deadline unless Renew is called.
func ManualRenew() AcquireOption { return func(o *acquireOpts) { o.manual = true } }

// Acquire takes partition p if no other lease on it is live, and fences
// its progress record under the new epoch. It returns a *HeldError
// (matching ErrHeld) when another lease is live.
func (c *Coordinator) Acquire(ctx context.Context, p leasehold.Partition, opts ...AcquireOption) (*Lease, error) {
	var o acquireOpts
	for _, opt := range opts {
		opt(&o)
	}
	l, err := c.acquireKey(ctx, partitionKey(p), p, false)
	if err != nil {
		return nil, err
	}
	if err := l.fenceProgress(ctx); err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
		defer cancel()
		if !errors.Is(err, leasehold.ErrLeaseLost) {
			_ = l.Release(rctx)
		}
		return nil, fmt.Errorf("coordinator: acquire partition %d: fence progress: %w", p, err)
	}
	c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventAcquired, Lease: l.info, Time: time.Now()})
	c.cfg.Logger.Debug("lease acquired", "partition", p, "epoch", l.info.Epoch, "worker", c.cfg.Worker)
	if !o.manual {
		l.startKeepalive()
	}
	return l, nil
}

func (l *Lease) startKeepalive() {
	l.stopped = make(chan struct{})
	go l.keepalive()
}

// acquireKey writes a fresh lease record to key if the key holds no live
// record. Each attempt that gets no answer is settled by reading the key
// from the stream leader: the record's token tells whether the write landed.
func (c *Coordinator) acquireKey(ctx context.Context, key string, p leasehold.Partition, member bool) (*Lease, error) {
	rec := record{
		Holder:   c.cfg.Worker,
		Token:    newToken(),
		TTLMilli: c.cfg.TTL.Milliseconds(),
		Acquired: time.Now().UTC(),
	}
	value, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	var (
		expect    uint64
		firstSent time.Time
		lastErr   error
		transient bool // the last attempt failed without an answer: back off
	)
	for attempt := 0; attempt < 8; attempt++ {
		if transient {
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("coordinator: acquire %s: %w (last error: %v)", key, ctx.Err(), lastErr)
			case <-time.After(backoff(attempt)):
			}
		}
		sent := time.Now()
		if firstSent.IsZero() {
			firstSent = sent
		}
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
		rev, err := c.b.put(rctx, key, value, expect, c.cfg.TTL)
		cancel()
		if err == nil {
			return c.newLease(key, p, member, rec, rev, sent), nil
		}
		lastErr = err
		if isRefusal(err) && !isConflict(err) {
			return nil, fmt.Errorf("coordinator: acquire %s: %w", key, err)
		}
		transient = !isRefusal(err)
		// The key holds something, or the outcome is unknown: read it.
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
		e, rerr := c.b.last(rctx, key)
		cancel()
		if rerr != nil {
			lastErr = fmt.Errorf("%w (reading the key back: %v)", err, rerr)
			transient = true
			continue
		}
		switch e.kind {
		case entryNone:
			expect = 0
		case entryMarker:
			expect = e.rev
		case entryValue:
			r, derr := decodeRecord(e.data)
			if derr != nil {
				return nil, fmt.Errorf("coordinator: acquire %s: the key holds a value leasehold did not write (%v): remove it with `nats kv del %s %s`", key, derr, c.b.name, key)
			}
			if r.Token == rec.Token {
				// An earlier attempt landed. Count the lease from the first
				// send, the earliest it can have been stored.
				l := c.newLease(key, p, member, rec, e.rev, firstSent)
				if ctx.Err() != nil {
					_ = l.Release(context.WithoutCancel(ctx))
					return nil, fmt.Errorf("coordinator: acquire %s: %w", key, ctx.Err())
				}
				return l, nil
			}
			return nil, &HeldError{Lease: leasehold.Lease{Partition: p, Epoch: epochOf(r, e.rev), Holder: r.Holder, Acquired: r.Acquired}}
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("coordinator: acquire %s: %w", key, ctx.Err())
		}
	}
	// The key changed hands between every read and write: others are
	// acquiring and releasing it as fast as this worker can look.
	return nil, fmt.Errorf("%w: %s changed hands %d times while this worker tried to take it (last refusal: %v)", ErrHeld, key, 8, lastErr)
}

func backoff(attempt int) time.Duration {
	d := 10 * time.Millisecond << min(attempt, 6)
	return d/2 + time.Duration(int64(d/2)*int64(time.Now().UnixNano()%1000)/1000)
}
