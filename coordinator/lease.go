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

// ErrReleased is the cause of a lease context's cancellation after Release.
var ErrReleased = errors.New("coordinator: lease released")

// LostError is the cause of a lost lease's cancellation. It matches
// leasehold.ErrLeaseLost.
type LostError struct {
	Lease  leasehold.Lease
	Lock   string // the lock's name, for a lock
	Member bool   // the lease was a membership registration
	Reason LostReason
	Holder string // who holds the partition now, when known
	Err    error  // the refusal, when there was one
}

func (e *LostError) Error() string {
	what := "partition " + e.Lease.Partition.String()
	switch {
	case e.Lock != "":
		what = fmt.Sprintf("lock %q", e.Lock)
	case e.Member:
		what = "membership"
	}
	msg := fmt.Sprintf("leasehold: lease lost: %s epoch %d held by %s", what, e.Lease.Epoch, e.Lease.Holder)
	switch e.Reason {
	case LostDeadline:
		msg += ": no renewal succeeded before the local deadline; stop writing, sinks will refuse this epoch once a successor takes over"
	case LostRefused:
		msg += ": the server refused the write because another worker took the partition"
		if e.Holder != "" {
			msg += " (now held by " + e.Holder + ")"
		}
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Is makes errors.Is(err, leasehold.ErrLeaseLost) true.
func (e *LostError) Is(target error) bool { return target == leasehold.ErrLeaseLost }

// Unwrap returns the server's refusal, if any.
func (e *LostError) Unwrap() error { return e.Err }

// Lease is a live lease on a partition or a named lock (or a membership
// registration). It renews itself until Release, or until it is lost;
// Context and Done report the loss. Its methods are safe for concurrent
// use.
type Lease struct {
	c      *Coordinator
	key    string // the lease key, which is also the fence record's key
	kind   leaseKind
	name   string // the lock's name
	info   leasehold.Lease
	member bool
	value  []byte // the renewal value: the record with the epoch filled in
	rec    record // the record value encodes
	token  string
	// session is the member registration that keeps a session-held
	// partition lease alive; nil for a lease that renews itself.
	session     *Lease
	stopSession func() bool
	releasing   atomic.Bool  // Release has begun: a change the watch shows is its own
	notices     atomic.Int32 // notices naming this lease since its check began; 0 with no check in flight

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu  sync.Mutex // serialises writes to the lease key
	rev uint64     // revision of the last write on the lease key

	dmu      sync.Mutex // guards the deadline apart from mu, so a slow write cannot hold it back
	deadline time.Time  // local deadline, with a monotonic reading
	timer    *time.Timer
	ended    error // why the lease ended (*LostError or ErrReleased); nil while held

	pmu      sync.Mutex // serialises writes to the fence record
	fenceRev uint64     // revision of the last write on the fence record
	fenced   fenceRecord
	previous fenceRecord // the record the fence step replaced: who held it before
	prior    prior       // what the lease key held when it was written: how the last holder let go
	// displaced is the lease of a live session whose record this
	// acquisition overwrote as unlisted (acquireOpts.orphan): its holder
	// is told (notify), as it does not watch the partition records.
	displaced leasehold.Lease
	progRead  bool     // the fence record has been written under this lease
	repaired  []string // what a repairing fence step rewrote

	stopOnce sync.Once
	stop     chan struct{} // closes to stop the keepalive
	stopped  chan struct{} // closed when the keepalive has returned
}

// Partition is the leased partition (0 for a lock).
func (l *Lease) Partition() leasehold.Partition { return l.info.Partition }

// Name is the lock's name, or "" for a partition.
func (l *Lease) Name() string { return l.name }

// Epoch is the lease's fencing token.
func (l *Lease) Epoch() leasehold.Epoch { return l.info.Epoch }

// Info describes the lease as a value.
func (l *Lease) Info() leasehold.Lease { return l.info }

// Context is cancelled when the lease is lost or released;
// context.Cause tells which (a *LostError or ErrReleased).
func (l *Lease) Context() context.Context { return l.ctx }

// Done is closed when the lease is lost or released.
func (l *Lease) Done() <-chan struct{} { return l.ctx.Done() }

// Err is nil while the lease is held, and afterwards the reason it is not.
func (l *Lease) Err() error {
	if l.ctx.Err() == nil {
		return nil
	}
	return context.Cause(l.ctx)
}

// Deadline is the local deadline: the send time of the last successful
// renewal plus the TTL minus the margin. A session-held lease has its
// session's deadline.
func (l *Lease) Deadline() time.Time {
	if l.session != nil {
		return l.session.Deadline()
	}
	l.dmu.Lock()
	defer l.dmu.Unlock()
	return l.deadline
}

// Progress is the input sequence committed for the partition, as of the
// acquisition (fenced under this lease's epoch) or the last Commit.
func (l *Lease) Progress() uint64 {
	l.pmu.Lock()
	defer l.pmu.Unlock()
	return l.fenced.Seq
}

func (l *Lease) String() string {
	what := "partition " + l.info.Partition.String()
	switch l.kind {
	case kindLock:
		what = fmt.Sprintf("lock %q", l.name)
	case kindMember:
		what = "membership"
	}
	return fmt.Sprintf("%s epoch %d (%s)", what, l.info.Epoch, l.info.Holder)
}

func (c *Coordinator) newLease(t target, rec record, rev uint64, sent time.Time, session *Lease) *Lease {
	rec.Epoch = rev
	value, _ := json.Marshal(rec)
	l := &Lease{
		c:      c,
		key:    t.key,
		kind:   t.kind,
		name:   t.name,
		info:   c.b.leaseOf(t, rec, rev),
		member: t.kind == kindMember,
		value:  value,
		rec:    rec,
		token:  rec.Token,
		rev:    rev,
		stop:   make(chan struct{}),
	}
	l.info.Epoch = leasehold.Epoch(rev)
	l.ctx, l.cancel = context.WithCancelCause(context.Background())
	if session != nil {
		// No timer and no renewals of its own: the session's deadline and
		// end are the lease's.
		l.session = session
		// A session that has already ended runs sessionEnded at once, in
		// a goroutine of its own that reads stopSession: set it under dmu.
		l.dmu.Lock()
		l.stopSession = context.AfterFunc(session.ctx, l.sessionEnded)
		l.dmu.Unlock()
		return l
	}
	l.dmu.Lock()
	l.deadline = sent.Add(c.cfg.TTL - c.cfg.Margin)
	l.timer = time.AfterFunc(time.Until(l.deadline), l.deadlinePassed)
	l.dmu.Unlock()
	return l
}

func (l *Lease) deadlinePassed() {
	l.dmu.Lock()
	late := !time.Now().Before(l.deadline)
	l.dmu.Unlock()
	if late {
		l.lose(LostDeadline, "", nil)
	}
}

// lose cancels the lease with a *LostError; only the first end (loss or
// release) counts. Observers hear of the loss before the context is
// cancelled, so whoever waits on Done finds it recorded.
func (l *Lease) lose(reason LostReason, holder string, err error) *LostError {
	lerr := &LostError{Lease: l.info, Lock: l.name, Member: l.member, Reason: reason, Holder: holder, Err: err}
	if prev := l.end(lerr); prev != nil {
		if prevLost, ok := prev.(*LostError); ok {
			return prevLost
		}
		return lerr
	}
	l.c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventLost, Lease: l.info, Member: l.member, Lock: l.name, Reason: reason, Err: err, Holder: holder, Time: time.Now()})
	l.logLost(reason, holder, err)
	l.finish(lerr)
	return lerr
}

// end records why the lease ended and returns nil, or returns the earlier
// reason if it had already ended.
func (l *Lease) end(cause error) error {
	l.dmu.Lock()
	defer l.dmu.Unlock()
	if l.ended != nil {
		return l.ended
	}
	l.ended = cause
	if l.timer != nil {
		l.timer.Stop()
	}
	return nil
}

// finish cancels the context with cause and stops the keepalive.
func (l *Lease) finish(cause error) {
	l.dmu.Lock()
	stop := l.stopSession
	l.dmu.Unlock()
	if stop != nil {
		stop()
	}
	l.cancel(cause)
	l.signalStop()
}

// check reads the lease key from the stream leader to settle an ambiguous
// or refused write: it returns true when the last write on the key is one of
// this lease's, updating the revision, and otherwise marks the lease lost.
func (l *Lease) check(ctx context.Context, cause error) (bool, error) {
	e, err := l.c.b.last(ctx, l.key)
	if err != nil {
		return false, fmt.Errorf("%w (and reading the lease back failed: %w)", cause, err)
	}
	if e.kind == entryValue {
		if r, derr := decodeRecord(e.data); derr == nil {
			if r.Token == l.token {
				l.rev = e.rev
				return true, nil
			}
			return false, l.lose(LostRefused, r.Holder, cause)
		}
	}
	return false, l.lose(LostRefused, "", cause)
}

// Renew extends the lease on the server by the TTL. It returns an error
// matching leasehold.ErrLeaseLost when the lease is gone, and another error
// when the outcome is not known yet (the lease may still be held; the
// local deadline decides).
//
// A session-held lease renews its session: the member registration.
func (l *Lease) Renew(ctx context.Context) error {
	if l.session != nil {
		if err := l.Err(); err != nil {
			return err
		}
		return l.session.Renew(ctx)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.Err(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
	defer cancel()
	sent := time.Now()
	rev, err := l.c.b.put(ctx, l.key, l.value, l.rev, l.c.cfg.TTL)
	if err == nil {
		l.rev = rev
		l.extend(sent)
		l.c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventRenewed, Lease: l.info, Member: l.member, Lock: l.name, Latency: time.Since(sent), Time: time.Now()})
		return nil
	}
	err = fmt.Errorf("renew %s: %w", l, err)
	if isConflict(err) || !isRefusal(err) {
		rctx, rcancel := context.WithTimeout(context.Background(), l.c.cfg.RequestTimeout)
		defer rcancel()
		ours, cerr := l.check(rctx, err)
		if cerr != nil {
			if !errors.Is(cerr, leasehold.ErrLeaseLost) {
				l.c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventRenewFailed, Lease: l.info, Member: l.member, Lock: l.name, Err: cerr, Time: time.Now()})
			}
			return cerr
		}
		if ours {
			// An earlier renewal landed after all; the next one will use
			// its revision. The deadline stays where it is: when that
			// renewal was stored is not known.
			err = fmt.Errorf("%w (the lease is still held at revision %d; retrying)", err, l.rev)
		}
	}
	l.c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventRenewFailed, Lease: l.info, Member: l.member, Lock: l.name, Err: err, Time: time.Now()})
	return err
}

// advertise makes holds (encodeHolds) the partitions l, a member
// registration, lists (none with unlisted), and writes it at once: the
// write is a renewal. Later renewals repeat it.
func (l *Lease) advertise(ctx context.Context, holds string, unlisted bool) error {
	l.mu.Lock()
	rec := l.rec
	rec.Holds = &holds
	if unlisted {
		rec.Holds = nil
	}
	value, err := json.Marshal(rec)
	if err == nil {
		l.rec, l.value = rec, value
	}
	l.mu.Unlock()
	if err != nil {
		return err
	}
	return l.Renew(ctx)
}

// extend moves the local deadline after a write sent at sent succeeded.
func (l *Lease) extend(sent time.Time) {
	d := sent.Add(l.c.cfg.TTL - l.c.cfg.Margin)
	l.dmu.Lock()
	defer l.dmu.Unlock()
	if l.ended == nil && d.After(l.deadline) {
		l.deadline = d
		l.timer.Reset(time.Until(d))
	}
}

// Release gives the lease up so that the next holder need not wait for the
// TTL: a purge of the key that succeeds only if the lease is still this
// one. It returns an error matching leasehold.ErrLeaseLost when another
// worker already holds the partition. Calling it again returns nil.
func (l *Lease) Release(ctx context.Context) error {
	l.releasing.Store(true)
	l.signalStop()
	if l.stopped != nil {
		<-l.stopped
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.Err(); err != nil {
		if errors.Is(err, ErrReleased) {
			return nil
		}
		return err
	}
	var err error
	for attempt := 0; ; attempt++ {
		var step releaseStep
		step, err = l.releaseOnce(ctx)
		if step == releaseLost {
			return err
		}
		if step == releaseDone || attempt == releaseTries-1 {
			break
		}
		if step == releaseWait {
			select {
			case <-ctx.Done():
			case <-timeAfter(backoff(attempt)):
			}
		}
		if ctx.Err() != nil {
			break
		}
	}
	switch {
	case err != nil && l.session != nil:
		// The record lives as long as the session: the worker group
		// removes it at a later reconciliation, or the session's end frees it.
		err = fmt.Errorf("release %s: %w (the worker group retries; the partition is free at the latest when this worker's registration ends)", l, err)
		l.logReleaseFailed(err)
	case err != nil:
		// The lease will expire on its own within the TTL.
		err = fmt.Errorf("release %s: %w (it expires on its own within %v)", l, err, l.c.cfg.TTL)
		l.logReleaseFailed(err)
	}
	if l.end(ErrReleased) == nil {
		l.c.cfg.Observer.LeaseEvent(l.ctx, Event{Kind: EventReleased, Lease: l.info, Member: l.member, Lock: l.name, Err: err, Time: time.Now()})
		l.finish(ErrReleased)
	}
	return err
}

// releaseTries bounds Release's purges. A purge refused because a write
// to the key is still being stored is tried again after a backoff; the
// caller's context bounds the whole.
const releaseTries = 8

// releaseStep is what one purge of Release leaves to do.
type releaseStep int

const (
	releaseDone  releaseStep = iota // released, or refused for good: err says which
	releaseLost                     // another acquisition holds the key: err is the lease's loss
	releaseAgain                    // try again at once, at the revision read back
	releaseWait                     // try again after a backoff
)

// releaseOnce sends one revision-checked purge of l's key, within
// RequestTimeout, and reads the key back when it is refused or not
// answered. It backs off (releaseWait) when the server refused the purge
// because an earlier write to the key is still being stored (10164 on a
// replicated bucket, where the key read back still shows the revision
// before that write), or when the key shows the very revision that was
// refused. l.mu is held.
func (l *Lease) releaseOnce(ctx context.Context) (releaseStep, error) {
	ctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
	defer cancel()
	err := l.c.b.purge(ctx, l.key, l.rev, l.c.b.markerTTL)
	if err == nil {
		return releaseDone, nil
	}
	if !isConflict(err) && isRefusal(err) {
		return releaseDone, err
	}
	// Refused by revision, or no answer: read the key to see whether the
	// lease is still this one (a renewal landed unseen) or gone.
	e, rerr := l.c.b.last(ctx, l.key)
	if rerr != nil {
		return releaseWait, fmt.Errorf("%w (reading the key back: %v)", err, rerr)
	}
	if e.kind != entryValue {
		// A marker or nothing: the purge landed, or the lease expired.
		return releaseDone, nil
	}
	r, derr := decodeRecord(e.data)
	if derr != nil || r.Token != l.token {
		holder := ""
		if derr == nil {
			holder = r.Holder
		}
		return releaseLost, l.lose(LostRefused, holder, fmt.Errorf("release %s: %w", l, err))
	}
	step := releaseAgain
	if e.rev == l.rev || isInFlight(err) {
		step = releaseWait
	}
	l.rev = e.rev
	return step, err
}

func (l *Lease) signalStop() { l.stopOnce.Do(func() { close(l.stop) }) }

// keepalive renews the lease every RenewEvery until it is lost or released;
// after a failed renewal it retries sooner.
func (l *Lease) keepalive() {
	defer close(l.stopped)
	every := l.c.cfg.RenewEvery
	retry := max(every/4, 50*time.Millisecond)
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-l.ctx.Done():
			return
		case <-t.C:
		}
		err := l.Renew(context.Background())
		switch {
		case err == nil:
			t.Reset(every)
		case errors.Is(err, leasehold.ErrLeaseLost) || errors.Is(err, ErrReleased):
			return
		default:
			l.c.cfg.Logger.Debug("lease renewal failed; retrying", "partition", l.info.Partition, "epoch", l.info.Epoch, "err", err)
			t.Reset(retry)
		}
	}
}
