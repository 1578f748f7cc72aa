package pgsink

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// ApplyTx runs fn in a transaction fenced by stamp: the transaction first
// records stamp's epoch and acquisition on its fence row (refusing a stale
// or split-brain stamp, with no call to fn) and its (scope, idempotency
// key), then calls fn, then commits. The fence row stays locked until the
// commit, so no newer epoch is recorded while fn runs (other writers of
// the same epoch and acquisition are not held up: the lock is shared among
// them). A key applied before is a duplicate: fn is not called and ApplyTx
// returns nil. An error from fn rolls everything back and is returned.
//
// The transaction runs under Config.LockTimeout and Config.TxIdleTimeout:
// a raise waits for it, so it must not hold the fence row for ever.
func (s *Sink) ApplyTx(ctx context.Context, stamp leasehold.Stamp, fn func(ctx context.Context, tx pgx.Tx) error) (err error) {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgsink: apply: %w", err)
	}
	ctx, span := s.rep.StartApply(ctx, []sink.Effect{{Stamp: stamp}})
	defer span.End()
	if err := stamp.Validate(); err != nil {
		err = fmt.Errorf("pgsink: apply: %w", err)
		s.rep.Report(ctx, sink.Decision{Outcome: sink.BadStamp, Stamp: stamp, Err: err})
		return err
	}
	if err := s.verify(ctx, stamp, ""); err != nil {
		return err
	}
	tx, err := s.db.BeginTx(ctx, s.txOpts)
	if err != nil {
		return s.failed(ctx, stamp, "", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	fenced, inserted, err := s.fenceTx(ctx, tx, stamp)
	if err != nil {
		return err
	}
	if !fenced {
		return s.refuse(ctx, tx, stamp, "")
	}
	if inserted {
		if err := fn(ctx, tx); err != nil {
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: stamp, Err: err})
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return s.failed(ctx, stamp, "", err)
	}
	s.report(ctx, &sink.Effect{Stamp: stamp}, inserted)
	return nil
}

// fenceTx locks stamp's fence row in tx, raising it if stamp's epoch is
// the newer, and inserts stamp's key. fenced false means the fence refuses
// stamp; tx then holds the fence row locked (or no row exists to lock, and
// none can be refused), so the state it reads is the one that refused.
//
// The share lock comes first, as in Apply. When it misses, the fence is
// judged before it is raised, and refusal needs no further lock: the share
// lock may have missed because the row was raised while it waited, and
// READ COMMITTED then leaves the newer version share-locked by this
// transaction although it did not match. Upgrading that lock to raise the
// row would wait for every other such transaction, each waiting for this
// one: two stale calls behind a raise would deadlock (PostgreSQL breaks
// the cycle after deadlock_timeout by failing one with SQLSTATE 40P01).
// Only a stamp the fence admits goes on to the upsert, and then the share
// lock did not match a row, so the transaction holds none to upgrade.
func (s *Sink) fenceTx(ctx context.Context, tx pgx.Tx, st leasehold.Stamp) (fenced, inserted bool, err error) {
	var f, k int
	p, e := int32(st.Partition), int64(st.Epoch)
	if err := tx.QueryRow(ctx, s.sql.txFast, st.Scope, p, e, st.Acquisition, st.Key).Scan(&f, &k); err != nil {
		return false, false, s.failed(ctx, st, "", err)
	}
	if f == 1 {
		return true, k == 1, nil
	}
	state, err := s.readFence(ctx, tx, st.Fence())
	if err != nil {
		return false, false, s.failed(ctx, st, "", err)
	}
	if v, _ := leasehold.Judge(state, st); v != leasehold.Admit {
		return false, false, nil
	}
	if err := tx.QueryRow(ctx, s.sql.txRaise, st.Scope, p, e, st.Acquisition, st.Key, st.Worker, s.lockMs).Scan(&f, &k); err != nil {
		return false, false, s.failed(ctx, st, "", err)
	}
	return f == 1, k == 1, nil
}
