package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ErrWorkerIDTaken is matched by the error Run returns when another live
// process is registered under this worker's ID.
var ErrWorkerIDTaken = errors.New("coordinator: the worker ID is taken by another live process")

// WorkerIDTakenError reports a registration under this worker's ID that
// its holder kept renewing while this worker waited to register: another
// process is running under the same ID, and one of them must get another.
type WorkerIDTakenError struct {
	Worker string
	Bucket string
	// Registered is when the live registration was made, by its record.
	Registered time.Time
}

func (e *WorkerIDTakenError) Error() string {
	since := ""
	if !e.Registered.IsZero() {
		since = " since " + e.Registered.UTC().Format(time.RFC3339)
	}
	return fmt.Sprintf("coordinator: worker ID %q is taken: another live process is registered under it in lease bucket %s%s and keeps renewing; "+
		"give every worker its own ID (coordinator.Config.Worker, worker.Config.Coordinator.Worker, `leasehold worker --worker-id`)", e.Worker, e.Bucket, since)
}

// Is makes errors.Is(err, ErrWorkerIDTaken) true.
func (e *WorkerIDTakenError) Is(target error) bool { return target == ErrWorkerIDTaken }

// register takes this worker's member key. A registration already there
// is either another live process under the same ID, or an earlier
// incarnation of this worker that crashed and whose registration has not
// expired yet: a live holder renews it (every RenewEvery of its own, at
// most half its TTL), a dead one never does. So register waits, reading
// the key, until the registration expires (then it registers) or is
// renewed (then it returns a *WorkerIDTakenError at once, instead of
// waiting for ever beside a process that will never go). A record
// leasehold did not write there is taken over once it has stayed
// unchanged for a TTL.
func (g *group) register(ctx context.Context) error {
	var (
		foreignRev   uint64
		foreignSince time.Time
		takeover     uint64
		other        registration // the registration found under this ID
	)
	for attempt := 0; ; attempt++ {
		started := time.Now()
		l, err := g.c.acquireKey(ctx, memberTarget(g.c.cfg.Worker), acquireOpts{takeover: takeover, advertise: g.c.sessions()})
		if err == nil {
			l.startKeepalive()
			g.member = l
			g.watchLoss(l)
			g.wrote(uint64(l.info.Epoch), started)
			return nil
		}
		var (
			held    *HeldError
			foreign *ForeignRecordError
		)
		switch {
		case errors.As(err, &foreign):
			if foreign.Revision != foreignRev {
				foreignRev, foreignSince = foreign.Revision, time.Now()
				g.c.cfg.Logger.Warn("this worker's member key holds a record leasehold did not write; taking it over if it stays unchanged for a TTL",
					"worker", g.c.cfg.Worker, "revision", foreign.Revision, "reason", foreign.Reason)
			} else if time.Since(foreignSince) >= g.c.cfg.TTL {
				takeover = foreignRev
				continue
			}
		case errors.As(err, &held):
			if err := g.watchRegistration(ctx, &other); err != nil {
				return err
			}
		case attempt > 3:
			return fmt.Errorf("coordinator: register worker %s: %w", g.c.cfg.Worker, err)
		}
		select {
		case <-ctx.Done():
			if other.rev != 0 {
				return fmt.Errorf("coordinator: register worker %s: stopped while waiting for an earlier registration under this ID to expire: %w", g.c.cfg.Worker, ctx.Err())
			}
			return fmt.Errorf("coordinator: register worker %s: %w", g.c.cfg.Worker, ctx.Err())
		case <-time.After(min(g.c.cfg.RenewEvery, time.Second)):
		}
	}
}

// registration is what register saw of a registration under its ID.
type registration struct {
	token string    // its acquisition's token, which every renewal repeats
	rev   uint64    // the revision it was first seen at
	since time.Time // when it was first seen
	ttl   time.Duration
}

// watchRegistration reads the registration under this worker's ID through
// the stream leader and compares it with what was seen before: renewed
// since (the same acquisition at a later revision) means another live
// process holds the ID, and is an error. One that neither renews nor
// expires well past its TTL is an error too, since the wait would have no
// end.
func (g *group) watchRegistration(ctx context.Context, seen *registration) error {
	rctx, cancel := context.WithTimeout(ctx, g.c.cfg.RequestTimeout)
	e, err := g.c.b.last(rctx, memberKey(g.c.cfg.Worker))
	cancel()
	if err != nil || e.kind != entryValue {
		return nil // gone, or unreadable for now: the next attempt tells
	}
	r, err := decodeRecord(e.data)
	if err != nil {
		return nil // the next attempt reports it as foreign
	}
	switch {
	case seen.rev != 0 && r.Token == seen.token && e.rev != seen.rev:
		return &WorkerIDTakenError{Worker: g.c.cfg.Worker, Bucket: g.c.b.name, Registered: r.Acquired}
	case seen.rev == 0 || r.Token != seen.token:
		*seen = registration{token: r.Token, rev: e.rev, since: time.Now(), ttl: time.Duration(r.TTLMilli) * time.Millisecond}
		g.c.cfg.Logger.Warn("a registration under this worker ID is there: if it is renewed, another live process has this ID and this one stops; if it expires (an earlier process that crashed), this one takes its place",
			"worker", g.c.cfg.Worker, "registered", r.Acquired, "expires_within", seen.ttl)
	case time.Since(seen.since) > 2*max(seen.ttl, g.c.cfg.TTL)+5*time.Second:
		return fmt.Errorf("coordinator: register worker %s: the registration under this ID at revision %d has neither been renewed nor expired in %v, twice its TTL of %v: check the lease bucket's per-message TTLs (`leasehold status` lists what it holds)",
			g.c.cfg.Worker, e.rev, time.Since(seen.since).Round(time.Second), seen.ttl)
	}
	return nil
}

func memberTarget(worker string) target { return target{kind: kindMember, key: memberKey(worker)} }

// checkMember reads member id's record through the stream leader, once it
// has looked stale at its revision: by its headers, not by timing, so that
// a registration whose renewals this worker saw late is never dropped.
func (g *group) checkMember(ctx context.Context, id string, m *member) {
	rctx, cancel := context.WithTimeout(ctx, g.c.cfg.RequestTimeout)
	e, err := g.c.b.last(rctx, memberKey(id))
	cancel()
	if err != nil {
		return // looked at again at the next reconciliation
	}
	switch {
	case e.kind != entryValue:
		// Gone: the watch will say so.
	case e.rev != m.rev:
		m.rev, m.since, m.sum = e.rev, time.Now(), 0 // the watch is behind
	default:
		_, reason := foreignReason(e.data, e.header)
		m.checked, m.ttlless = true, reason != ""
	}
}

// warnOnce logs msg at WARN the first time it is told about revision rev
// of key, and about a later revision of the same key at most once per
// warnEvery: a record rewritten again and again (by a writer that is not
// leasehold, or one that keeps a forged record renewed) costs a line a
// minute, which says how many revisions went unlogged since the last.
func (g *group) warnOnce(key string, rev uint64, msg string, args ...any) {
	w, ok := g.warned[key]
	if ok && w.rev == rev {
		return
	}
	now := time.Now()
	if ok && now.Sub(w.at) < warnEvery {
		w.rev, w.skipped = rev, w.skipped+1
		g.warned[key] = w
		return
	}
	args = append(args, "key", key, "bucket", g.c.b.name)
	if w.skipped > 0 {
		args = append(args, "revisions_not_logged", w.skipped)
	}
	g.warned[key] = warning{rev: rev, at: now}
	g.c.cfg.Logger.Warn(msg, args...)
}

// warnEvery is how often warnOnce logs about one key.
const warnEvery = time.Minute

// warning is what warnOnce last did about a key.
type warning struct {
	rev     uint64    // the revision last told about
	at      time.Time // when a line was last logged
	skipped int       // revisions told about since, not logged
}

func (g *group) releaseMember() {
	if g.member == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), g.c.cfg.RequestTimeout*2)
	defer cancel()
	_ = g.member.Release(ctx)
	g.member = nil
}
