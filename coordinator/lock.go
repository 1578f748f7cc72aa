package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// Locks are leases on named resources ("account:42", "report-generator")
// in the lease bucket, with the guarantees of partition leases: the token
// is the revision of the write that acquired the lock, strictly increasing
// per name (also across re-creation of the bucket, through the fence
// record), at most one holder is live, the lease's Context ends when it is
// lost, it renews itself, and Release hands it to the next waiter at once.
// A holder writes through sinks with l.Info().Stamp(key): its scope is
// leasehold.LockScope(bucket scope, name) and its partition 0, so a holder
// paused past its TTL is refused exactly as a zombie worker is.

// lockKey is the lease key (and fence-record key) of lock name.
func lockKey(name string) string { return lockKeyPrefix + encodeLockName(name) }

// encodeLockName turns a lock name (printable ASCII, see
// leasehold.ValidateLockName) into one KV key token, reversibly: letters,
// digits and '-' stay, every other byte becomes '_' and two upper-case hex
// digits ("account:42" is "account_3A42").
func encodeLockName(name string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(name))
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('_')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

// decodeLockName reverses encodeLockName. Only the spelling encodeLockName
// produces decodes: a key token has one name, and a name one token.
func decodeLockName(token string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(token); i++ {
		c := token[i]
		if c != '_' {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return "", fmt.Errorf("lock key %q holds %q", token, c)
			}
			b.WriteByte(c)
			continue
		}
		if i+2 >= len(token) {
			return "", fmt.Errorf("lock key %q ends in a partial escape", token)
		}
		hi, lo := unhex(token[i+1]), unhex(token[i+2])
		if hi < 0 || lo < 0 {
			return "", fmt.Errorf("lock key %q has a malformed escape", token)
		}
		d := byte(hi<<4 | lo)
		if d >= 'a' && d <= 'z' || d >= 'A' && d <= 'Z' || d >= '0' && d <= '9' || d == '-' {
			return "", fmt.Errorf("lock key %q escapes %q, which is spelt as itself", token, d)
		}
		b.WriteByte(d)
		i += 2
	}
	name := b.String()
	if err := leasehold.ValidateLockName(name); err != nil {
		return "", err
	}
	return name, nil
}

func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

func lockTarget(name string) (target, error) {
	if err := leasehold.ValidateLockName(name); err != nil {
		return target{}, fmt.Errorf("coordinator: lock %q: %w", name, err)
	}
	return target{kind: kindLock, key: lockKey(name), name: name}, nil
}

// TryLock takes the lock on resource name if no other lease on it is live.
// It returns a *HeldError (matching ErrHeld) naming the holder otherwise,
// and a *ForeignRecordError when the lock's key holds a record leasehold
// did not write. The lease's epoch is the lock's fencing token.
func (c *Coordinator) TryLock(ctx context.Context, name string, opts ...AcquireOption) (*Lease, error) {
	t, err := lockTarget(name)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, t, optionsOf(opts))
}

// Lock takes the lock on resource name, waiting while another holder has
// it: it watches the lock's key and tries again when the holder releases
// it or its lease expires, so a graceful hand-off takes one round trip,
// not a TTL. It returns when it holds the lock, with ctx's error, or with
// the error of an attempt that failed for another reason than a holder (no
// answer from the server, a fence record that refuses the acquisition). A
// record leasehold did not write on the key is taken over once it has
// stayed unchanged for a TTL.
func (c *Coordinator) Lock(ctx context.Context, name string, opts ...AcquireOption) (*Lease, error) {
	t, err := lockTarget(name)
	if err != nil {
		return nil, err
	}
	o := optionsOf(opts)
	// Watch first, so that a release between a refused try and the
	// watch's start is not missed.
	w, err := c.b.kv.Watch(ctx, t.key, jetstream.UpdatesOnly())
	if err != nil {
		return nil, fmt.Errorf("coordinator: lock %q: watch: %w", name, err)
	}
	defer stopWatcher(w)
	var (
		foreignRev  uint64
		foreignSeen time.Time
		heldTTL     = c.cfg.TTL
	)
	for {
		l, err := c.acquire(ctx, t, o)
		if err == nil {
			return l, nil
		}
		var held *HeldError
		var foreign *ForeignRecordError
		switch {
		case errors.As(err, &foreign):
			if foreign.Revision != foreignRev {
				foreignRev, foreignSeen = foreign.Revision, time.Now()
				c.cfg.Logger.Warn("lock key holds a record leasehold did not write; taking it over if it stays unchanged for a TTL",
					"lock", name, "revision", foreign.Revision, "reason", foreign.Reason)
			} else if time.Since(foreignSeen) >= c.cfg.TTL {
				o.takeover = foreignRev
				continue
			}
		case errors.Is(err, ErrHeld):
			o.takeover = 0
			errors.As(err, &held)
		default:
			// No answer, or the fence step refused: the caller decides
			// (RunSingleton retries a bounded number of times).
			return nil, err
		}
		if err := waitForChange(ctx, w, heldTTL); err != nil {
			return nil, fmt.Errorf("coordinator: lock %q: %w (last attempt: %v)", name, err, errLast(held, foreign, err))
		}
	}
}

func errLast(held *HeldError, foreign *ForeignRecordError, err error) error {
	switch {
	case held != nil:
		return held
	case foreign != nil:
		return foreign
	}
	return err
}

// waitForChange waits until the watched key is released, expires or
// changes hands, or until every, whichever comes first: a watch can miss
// what happened while its connection was down, and a holder that renews
// shows it is alive within a TTL.
func waitForChange(ctx context.Context, w jetstream.KeyWatcher, every time.Duration) error {
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			return nil
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("the watch ended")
			}
			if e == nil {
				continue
			}
			if e.Operation() != jetstream.KeyValuePut {
				return nil // released or expired
			}
			// A renewal repeats the holder's record; a new holder's
			// record differs from it, but it is held either way.
		}
	}
}

// LockHolder describes the live lease on lock name, read through the
// stream leader; ok is false when nobody holds it.
func (c *Coordinator) LockHolder(ctx context.Context, name string) (l leasehold.Lease, ok bool, err error) {
	t, err := lockTarget(name)
	if err != nil {
		return leasehold.Lease{}, false, err
	}
	e, err := c.b.last(ctx, t.key)
	if err != nil {
		return leasehold.Lease{}, false, fmt.Errorf("coordinator: read lock %q: %w", name, err)
	}
	if e.kind != entryValue {
		return leasehold.Lease{}, false, nil
	}
	r, foreign := foreignReason(e.data, e.header)
	if foreign != "" {
		return leasehold.Lease{}, false, &ForeignRecordError{Bucket: c.b.name, Key: t.key, Revision: e.rev, Reason: foreign}
	}
	return c.b.leaseOf(t, r, e.rev), true, nil
}
