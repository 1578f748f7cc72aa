package pgsink_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
)

// Stale ApplyTx calls that wait behind a raise are told they are stale.
// The successor raises the fence in its own ApplyTx and stays inside it;
// the former holder's calls, under the old epoch, wait for the row. When
// the raise commits, each of them finds the raised row locked by itself
// in share mode (READ COMMITTED locks the row's newest version before it
// re-checks it), and none may try to upgrade that lock: with several
// waiting, each would wait for the others, a deadlock PostgreSQL breaks by
// failing one with SQLSTATE 40P01 instead of the stale-epoch error.
func TestStaleApplyTxNoDeadlock(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	ctx := ctxFor(t, time.Minute)
	// No wait in this test may end in a lock timeout, however slow the
	// machine is.
	s := newSink(t, db, pgsink.Config{Prefix: "deadlock_", LockTimeout: -1})
	if err := s.Advance(ctx, lease("jobs", 5, 10)); err != nil {
		t.Fatal(err)
	}
	inside, release := make(chan struct{}), make(chan struct{})
	raised := make(chan error, 1)
	go func() {
		raised <- s.ApplyTx(ctx, stampOf(lease("jobs", 5, 11), "successor"), func(context.Context, pgx.Tx) error {
			close(inside)
			<-release
			return nil
		})
	}()
	<-inside
	const zombies = 4
	errs := make(chan error, zombies)
	ran := make(chan string, zombies)
	for i := range zombies {
		go func() {
			key := fmt.Sprintf("zombie-%d", i)
			errs <- s.ApplyTx(ctx, stampOf(lease("jobs", 5, 10), key), func(context.Context, pgx.Tx) error {
				ran <- key
				return nil
			})
		}()
	}
	waitLockWaiters(ctx, t, db, zombies, errs)
	close(release)
	if err := <-raised; err != nil {
		t.Fatalf("the successor's ApplyTx: %v", err)
	}
	for range zombies {
		err := <-errs
		var se *leasehold.StaleEpochError
		if !errors.As(err, &se) || se.Max != 11 || se.SplitBrain {
			t.Errorf("stale ApplyTx behind a raise = %v, want a stale-epoch error with max 11", err)
		}
	}
	select {
	case key := <-ran:
		t.Fatalf("the handler of %s ran under a stale epoch", key)
	default:
	}
	if n := s.Dropped(leasehold.FenceID{Scope: "jobs", Partition: 5}); n != zombies {
		t.Fatalf("Dropped = %d, want %d", n, zombies)
	}
}

// A holder paused inside ApplyTx holds the fence row in share mode. Its
// successor's raise waits for it at most Config.LockTimeout and then
// fails with ErrFenceLocked, having written nothing; and PostgreSQL ends
// the paused transaction once it has been idle for Config.TxIdleTimeout,
// after which the successor's raise goes through and the paused holder's
// write is lost to it.
func TestPausedHolderLockTimeout(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	ctx := ctxFor(t, 2*time.Minute)
	id := leasehold.FenceID{Scope: "jobs", Partition: 5}
	// The holder's transactions may stay idle for as long as the test
	// needs; the successor waits for the fence row a tenth of a second.
	holder := newSink(t, db, pgsink.Config{Prefix: "paused_", TxIdleTimeout: -1})
	successor := newSink(t, db, pgsink.Config{Prefix: "paused_", LockTimeout: 100 * time.Millisecond})
	if err := holder.Advance(ctx, lease("jobs", 5, 10)); err != nil {
		t.Fatal(err)
	}
	paused := pauseInside(ctx, t, holder, stampOf(lease("jobs", 5, 10), "paused"))

	next := lease("jobs", 5, 11)
	locked := func(what string, err error) {
		t.Helper()
		var le *pgsink.FenceLockedError
		if !errors.Is(err, pgsink.ErrFenceLocked) || !errors.As(err, &le) || le.Fence != id {
			t.Fatalf("the successor's %s behind a paused holder = %v, want an error matching ErrFenceLocked for %s", what, err, id)
		}
		for _, want := range []string{"lock timeout", "ApplyTx", "retry"} {
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("the successor's %s: %q does not say %q", what, err, want)
			}
		}
	}
	locked("Advance", successor.Advance(ctx, next))
	first := sink.Effect{Stamp: next.Stamp("first"), Subject: "s"}
	locked("Apply", successor.Apply(ctx, first))
	locked("ApplyTx", successor.ApplyTx(ctx, next.Stamp("first-tx"), func(context.Context, pgx.Tx) error { return nil }))
	if f, _ := successor.Fence(ctx, id); f.Epoch != 10 {
		t.Fatalf("fence %+v after the refused raises, want epoch 10", f)
	}
	if err := paused.resume(); err != nil {
		t.Fatalf("the holder's ApplyTx after its pause: %v", err)
	}
	// With the pause over, the raise goes through.
	if err := successor.Apply(ctx, first); err != nil {
		t.Fatal(err)
	}

	// A holder whose transactions the server ends when idle: the
	// successor's raise goes through once the paused transaction is
	// ended, and the paused write is not applied.
	bounded := newSink(t, db, pgsink.Config{Prefix: "paused_", TxIdleTimeout: 200 * time.Millisecond})
	paused = pauseInside(ctx, t, bounded, stampOf(next, "paused-again"))
	third := lease("jobs", 5, 12)
	for attempt := 1; ; attempt++ {
		err := successor.Advance(ctx, third)
		if err == nil {
			break
		}
		if !errors.Is(err, pgsink.ErrFenceLocked) || ctx.Err() != nil {
			t.Fatalf("the successor's Advance, attempt %d, while the paused transaction should be ended: %v", attempt, err)
		}
	}
	err := paused.resume()
	if err == nil || !strings.Contains(err.Error(), "TxIdleTimeout") {
		t.Fatalf("the paused holder's ApplyTx after the server ended it = %v, want an error naming Config.TxIdleTimeout", err)
	}
	var n int
	if err := db.QueryRow(ctx, "SELECT count(*) FROM "+bounded.Tables().Keys+" WHERE key = 'paused-again'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("the ended transaction's key: %d rows, %v; want none", n, err)
	}
	if f, _ := successor.Fence(ctx, id); f.Epoch != 12 {
		t.Fatalf("fence %+v, want epoch 12", f)
	}
}

// pausedTx is an ApplyTx whose handler waits inside the transaction until
// resumed: a holder paused mid-transaction, its session idle.
type pausedTx struct {
	release chan struct{}
	done    chan error
}

func pauseInside(ctx context.Context, t *testing.T, s *pgsink.Sink, st leasehold.Stamp) *pausedTx {
	t.Helper()
	p := &pausedTx{release: make(chan struct{}), done: make(chan error, 1)}
	inside := make(chan struct{})
	go func() {
		p.done <- s.ApplyTx(ctx, st, func(context.Context, pgx.Tx) error {
			close(inside)
			<-p.release
			return nil
		})
	}()
	select {
	case <-inside:
	case err := <-p.done:
		t.Fatalf("ApplyTx(%s) returned before its handler ran: %v", st.Key, err)
	}
	t.Cleanup(func() {
		select {
		case <-p.release:
		default:
			close(p.release)
			<-p.done
		}
	})
	return p
}

// resume lets the handler return and waits for ApplyTx.
func (p *pausedTx) resume() error {
	close(p.release)
	return <-p.done
}
