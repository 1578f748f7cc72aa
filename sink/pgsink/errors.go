package pgsink

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// ErrFenceLocked is matched by the error of a write that waited longer
// than Config.LockTimeout for a fence row's lock. Nothing was written; the
// write may be retried. Use errors.As with *FenceLockedError for the
// details.
var ErrFenceLocked = errors.New("pgsink: fence row locked")

// FenceLockedError reports a wait for a fence row that passed the lock
// timeout: another transaction holds the row, typically one writing under
// the previous epoch through ApplyTx while this write raises the fence.
type FenceLockedError struct {
	Fence   leasehold.FenceID
	Timeout time.Duration // Config.LockTimeout
	Err     error         // PostgreSQL's error (SQLSTATE 55P03)
}

func (e *FenceLockedError) Error() string {
	return fmt.Sprintf("the fence row of scope %s partition %d stayed locked by another transaction for longer than the lock timeout (%v), so nothing was written: "+
		"a transaction under another epoch holds it (an ApplyTx of the previous holder, which may be paused; PostgreSQL ends one left idle for Config.TxIdleTimeout); retry: %v",
		e.Fence.Scope, e.Fence.Partition, e.Timeout, e.Err)
}

// Is makes errors.Is(err, ErrFenceLocked) true.
func (e *FenceLockedError) Is(target error) bool { return target == ErrFenceLocked }

// Unwrap returns PostgreSQL's error.
func (e *FenceLockedError) Unwrap() error { return e.Err }

// describe says what a database error from a statement on fence id means
// for the caller.
func (s *Sink) describe(err error, id leasehold.FenceID) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
		return &FenceLockedError{Fence: id, Timeout: s.lockTimeout, Err: err}
	}
	return describe(err)
}

// describe says what a database error means for the caller.
func describe(err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "42P01":
			return fmt.Errorf("%w: the sink's tables are missing: run pgsink.CreateSchema", err)
		case pgErr.Code == "42703", pgErr.Code == "42P10":
			// A column, or the unique key ON CONFLICT names, is missing.
			return fmt.Errorf("%w: the sink's tables lack the scope: run pgsink.CreateSchema with Config.LegacyScope set to the scope that wrote them, which upgrades them in place: %w", ErrLegacySchema, err)
		case pgErr.Code == "25P03":
			return fmt.Errorf("PostgreSQL ended the transaction because it stayed idle longer than Config.TxIdleTimeout (the client paused, or fn waited outside the database), so nothing of it was written; retry with the same idempotency key: %w", err)
		case strings.HasPrefix(pgErr.Code, "08"), strings.HasPrefix(pgErr.Code, "57"), strings.HasPrefix(pgErr.Code, "53"):
			return fmt.Errorf("PostgreSQL is restarting, shutting down or out of resources, so the write may or may not have happened; retry with the same idempotency key, which applies it at most once: %w (%w)", err, sink.ErrUnavailable)
		}
		return err
	}
	if pgconn.SafeToRetry(err) {
		return fmt.Errorf("PostgreSQL is unreachable, nothing was written; retry: %w (%w)", err, sink.ErrUnavailable)
	}
	return fmt.Errorf("PostgreSQL did not answer, so the write may or may not have happened; retry with the same idempotency key, which applies it at most once: %w (%w)", err, sink.ErrUnavailable)
}
