// Package pgsink is a leasehold sink that writes to PostgreSQL (pgx v5).
//
// The fence, the dedupe and the effect are one statement. Raising a
// partition's maximum is an upsert of its fence row that only matches when
// the stored epoch is at or below the effect's (INSERT ... ON CONFLICT ...
// DO UPDATE ... WHERE fence.epoch <= EXCLUDED.epoch), feeding an insert of
// the effect keyed by its idempotency key; the upsert locks the fence row
// whether or not it updates it, so no newer epoch can be recorded between
// the check and the write, and a stale effect writes nothing.
//
// Most effects carry the epoch already recorded, and for them the sink
// takes a cheaper path: a FOR SHARE lock on the fence row where epoch =
// the effect's, feeding the insert. A raise (the upsert's DO UPDATE, or
// Advance) needs the row's update lock, which waits for every share lock's
// transaction to end; and a share lock taken after a raise committed
// re-reads the row (READ COMMITTED re-checks a locked row's newest
// version) and no longer matches. So an effect written under the share
// lock commits before any raise, and none lands after one. Writers of the
// same epoch share the lock and do not wait for each other. A fenced write
// costs about what a plain upsert does (see BenchmarkFencedVsPlain).
//
// A batch is one transaction.
//
// ApplyTx runs a handler's own SQL in the same fenced transaction: the
// fence row stays locked until the transaction ends.
//
// Tables are created by CreateSchema; their names are Config.Prefix
// followed by fence, effects and keys.
package pgsink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// DB is what the sink needs of a database handle. *pgxpool.Pool satisfies
// it; so does *pgx.Conn, for one goroutine at a time.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Config configures a Sink.
type Config struct {
	// DB is the database. Required.
	DB DB
	// Schema holds the tables. Default: the connection's search path.
	Schema string
	// Prefix starts every table name. Default "leasehold_".
	Prefix string
	// Name names the sink in decisions and logs. Default "postgres".
	Name string
	// Verifier, when set, turns on verified epochs (see sink.EpochCheck).
	Verifier sink.Verifier
	// Observer receives every decision. Optional.
	Observer sink.Observer
	// Logger receives rate-limited drop lines. Default slog.Default().
	Logger *slog.Logger
	// Telemetry selects the providers of the sink's spans and metrics (see
	// sink.Reporter). Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

func (c *Config) setDefaults() {
	if c.Prefix == "" {
		c.Prefix = "leasehold_"
	}
	if c.Name == "" {
		c.Name = "postgres"
	}
}

var identRE = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

func (c Config) validateNames() error {
	var errs []error
	if c.Schema != "" && !identRE.MatchString(c.Schema) {
		errs = append(errs, fmt.Errorf("schema %q: use lowercase letters, digits and '_'", c.Schema))
	}
	if !identRE.MatchString(c.Prefix) || len(c.Prefix) > 40 {
		errs = append(errs, fmt.Errorf("table prefix %q: use lowercase letters, digits and '_' (at most 40)", c.Prefix))
	}
	return errors.Join(errs...)
}

// Validate reports every problem with c.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if c.DB == nil {
		errs = append(errs, errors.New("DB is required: pass a *pgxpool.Pool"))
	}
	if err := c.validateNames(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Sink is a fenced PostgreSQL sink. It is safe for concurrent use.
type Sink struct {
	db       DB
	t        Tables
	rep      *sink.Reporter
	check    *sink.EpochCheck
	sqlOne   string // fence + effect, reporting both outcomes
	sqlFast  string // share-locked fence + effect, failing on a duplicate key
	sqlTxKey string // share-locked fence + key, for ApplyTx
	sqlFen   string // fence alone
	pkey     string // the effects table's primary key constraint
	sqlKey   string // fence + key, for ApplyTx
	sqlAdv   string
	sqlMax   string
}

var _ sink.Sink = (*Sink)(nil)

// New returns a sink over tables CreateSchema has created.
func New(cfg Config) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("pgsink: invalid config: %w", err)
	}
	cfg.setDefaults()
	t := tablesFor(cfg.Schema, cfg.Prefix)
	fence := fmt.Sprintf(`INSERT INTO %[1]s AS f (partition, epoch, holder) VALUES ($1, $2, $3)
		ON CONFLICT (partition) DO UPDATE SET epoch = EXCLUDED.epoch, holder = EXCLUDED.holder, updated_at = now()
		WHERE f.epoch <= EXCLUDED.epoch
		RETURNING 1`, t.Fence)
	return &Sink{
		db:    cfg.DB,
		t:     t,
		rep:   sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check: sink.NewEpochCheck(cfg.Verifier),
		sqlFast: fmt.Sprintf(`WITH f AS (SELECT 1 FROM %s WHERE partition = $1 AND epoch = $2 AND $3::text IS NOT NULL FOR SHARE)
			INSERT INTO %s (key, partition, epoch, subject, data, header)
			SELECT $4, $1, $2, $5, $6, $7 FROM f`, t.Fence, t.Effects),
		sqlTxKey: fmt.Sprintf(`WITH f AS (SELECT 1 FROM %s WHERE partition = $1 AND epoch = $2 AND $3::text IS NOT NULL FOR SHARE),
			k AS (INSERT INTO %s (key, partition, epoch) SELECT $4, $1, $2 FROM f ON CONFLICT (key) DO NOTHING RETURNING 1)
			SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM k)`, t.Fence, t.Keys),
		sqlFen: fence,
		pkey:   cfg.Prefix + "effects_pkey",
		sqlOne: fmt.Sprintf(`WITH f AS (%s), e AS (
			INSERT INTO %s (key, partition, epoch, subject, data, header)
			SELECT $4, $1, $2, $5, $6, $7 FROM f
			ON CONFLICT (key) DO NOTHING RETURNING 1)
			SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM e)`, fence, t.Effects),
		sqlKey: fmt.Sprintf(`WITH f AS (%s), k AS (
			INSERT INTO %s (key, partition, epoch) SELECT $4, $1, $2 FROM f
			ON CONFLICT (key) DO NOTHING RETURNING 1)
			SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM k)`, fence, t.Keys),
		sqlAdv: fmt.Sprintf(`INSERT INTO %[1]s AS f (partition, epoch, holder) VALUES ($1, $2, $3)
			ON CONFLICT (partition) DO UPDATE SET epoch = EXCLUDED.epoch, holder = EXCLUDED.holder, updated_at = now()
			WHERE f.epoch < EXCLUDED.epoch
			RETURNING 1`, t.Fence),
		sqlMax: fmt.Sprintf(`SELECT epoch, holder FROM %s WHERE partition = $1`, t.Fence),
	}, nil
}

// Tables returns the table names, quoted for SQL.
func (s *Sink) Tables() Tables { return s.t }

// Dropped returns how many effects of partition p were refused.
func (s *Sink) Dropped(p leasehold.Partition) uint64 { return s.rep.Dropped(p) }

// Apply writes the effects, fenced and deduplicated: one statement for one
// effect, one transaction for several (all or none).
func (s *Sink) Apply(ctx context.Context, effects ...sink.Effect) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgsink: apply: %w", err)
	}
	ctx, span := s.rep.StartApply(ctx, effects)
	defer span.End()
	if i, err := sink.ValidateEffects(effects); err != nil {
		if i >= 0 {
			s.rep.Report(ctx, sink.Decision{Outcome: sink.BadStamp, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
		}
		return err
	}
	for i := range effects {
		if err := s.verify(ctx, effects[i].Stamp, effects[i].Subject); err != nil {
			return err
		}
	}
	if len(effects) == 1 {
		return s.applyOne(ctx, &effects[0])
	}
	return s.applyBatch(ctx, effects)
}

// applyOne is the common case: one statement that share-locks the fence
// row where it holds the effect's epoch, and inserts the effect.
// Its insert has no ON CONFLICT clause, so that the command tag alone says
// what happened: one row is an applied effect; no row means the fence does
// not hold this epoch (none yet, a lower one to raise, or a higher one);
// and a duplicate key fails the whole statement with a unique violation.
// Either of the last two changed nothing, and is settled by the upsert.
func (s *Sink) applyOne(ctx context.Context, e *sink.Effect) error {
	tag, err := s.db.Exec(ctx, s.sqlFast, s.args(e)...)
	switch {
	case err == nil && tag.RowsAffected() == 1:
		s.report(ctx, e, 1)
		return nil
	case err == nil:
		// The fence does not hold this epoch; the statement changed
		// nothing. Raise, or refuse, with the upsert.
		return s.applyUpsert(ctx, e)
	case !s.isDuplicate(err):
		return s.failed(ctx, e.Stamp, e.Subject, err)
	}
	// The key was applied before, and the failed statement changed
	// nothing. A repeat is a duplicate only if its epoch is still
	// admitted: a zombie repeating an applied key is told it is stale.
	rows, err := s.db.Query(ctx, s.sqlFen, int32(e.Stamp.Partition), int64(e.Stamp.Epoch), e.Stamp.Worker)
	if err != nil {
		return s.failed(ctx, e.Stamp, e.Subject, err)
	}
	admitted := rows.Next()
	rows.Close()
	if err := rows.Err(); err != nil {
		return s.failed(ctx, e.Stamp, e.Subject, err)
	}
	if !admitted {
		return s.stale(ctx, e.Stamp, e.Subject)
	}
	s.report(ctx, e, 0)
	return nil
}

func (s *Sink) applyUpsert(ctx context.Context, e *sink.Effect) error {
	var fenced, inserted int
	if err := s.db.QueryRow(ctx, s.sqlOne, s.args(e)...).Scan(&fenced, &inserted); err != nil {
		return s.failed(ctx, e.Stamp, e.Subject, err)
	}
	if fenced == 0 {
		return s.stale(ctx, e.Stamp, e.Subject)
	}
	s.report(ctx, e, inserted)
	return nil
}

func (s *Sink) isDuplicate(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == s.pkey
}

func (s *Sink) args(e *sink.Effect) []any {
	var header []byte
	if len(e.Header) > 0 {
		header, _ = json.Marshal(e.Header)
	}
	return []any{int32(e.Stamp.Partition), int64(e.Stamp.Epoch), e.Stamp.Worker, e.Stamp.Key, e.Subject, e.Data, header}
}

func (s *Sink) report(ctx context.Context, e *sink.Effect, inserted int) {
	o := sink.Accepted
	if inserted == 0 {
		o = sink.Duplicate
	}
	s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: e.Stamp, Subject: e.Subject, Max: e.Stamp.Epoch})
}

func (s *Sink) applyBatch(ctx context.Context, effects []sink.Effect) (err error) {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	b := &pgx.Batch{}
	for i := range effects {
		b.Queue(s.sqlOne, s.args(&effects[i])...)
	}
	res := tx.SendBatch(ctx, b)
	inserted := make([]int, len(effects))
	staleAt := -1
	for i := range effects {
		var f int
		if err := res.QueryRow().Scan(&f, &inserted[i]); err != nil {
			res.Close()
			return s.failed(ctx, effects[i].Stamp, effects[i].Subject, err)
		}
		if f == 0 && staleAt < 0 {
			staleAt = i
		}
	}
	if err := res.Close(); err != nil {
		return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
	}
	if staleAt >= 0 {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		serr := s.stale(ctx, effects[staleAt].Stamp, effects[staleAt].Subject)
		return fmt.Errorf("pgsink: effect %d of %d: %w (no effect of the batch was applied)", staleAt+1, len(effects), serr)
	}
	if err := tx.Commit(ctx); err != nil {
		return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
	}
	for i := range effects {
		s.report(ctx, &effects[i], inserted[i])
	}
	return nil
}

// ApplyTx runs fn in a transaction fenced by stamp: the transaction first
// records stamp's epoch on the partition's fence row (refusing a stale
// one, with no call to fn) and its idempotency key, then calls fn, then
// commits. The fence row stays locked until the commit, so no newer epoch
// is recorded while fn runs (other writers of the same epoch are not held
// up: the lock is shared among them). A key applied before is a duplicate: fn is
// not called and ApplyTx returns nil. An error from fn rolls everything
// back and is returned.
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
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return s.failed(ctx, stamp, "", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	var fenced, inserted int
	args := []any{int32(stamp.Partition), int64(stamp.Epoch), stamp.Worker, stamp.Key}
	if err := tx.QueryRow(ctx, s.sqlTxKey, args...).Scan(&fenced, &inserted); err != nil {
		return s.failed(ctx, stamp, "", err)
	}
	if fenced == 0 {
		if err := tx.QueryRow(ctx, s.sqlKey, args...).Scan(&fenced, &inserted); err != nil {
			return s.failed(ctx, stamp, "", err)
		}
	}
	if fenced == 0 {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return s.stale(ctx, stamp, "")
	}
	if inserted == 1 {
		if err := fn(ctx, tx); err != nil {
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: stamp, Err: err})
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return s.failed(ctx, stamp, "", err)
	}
	e := sink.Effect{Stamp: stamp}
	s.report(ctx, &e, inserted)
	return nil
}

// Advance raises partition p's maximum to e if it is lower.
func (s *Sink) Advance(ctx context.Context, p leasehold.Partition, e leasehold.Epoch) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgsink: advance: %w", err)
	}
	if err := sink.ValidateAdvance(p, e); err != nil {
		return fmt.Errorf("pgsink: advance: %w", err)
	}
	st := leasehold.Stamp{Partition: p, Epoch: e}
	if err := s.verify(ctx, st, ""); err != nil {
		return err
	}
	tag, err := s.db.Exec(ctx, s.sqlAdv, int32(p), int64(e), sink.HolderFrom(ctx))
	if err != nil {
		return fmt.Errorf("pgsink: advance partition %d to epoch %d: %w", p, e, describe(err))
	}
	if tag.RowsAffected() > 0 {
		s.rep.Report(ctx, sink.Decision{Outcome: sink.Advanced, Stamp: st, Max: e})
	}
	return nil
}

// MaxEpoch returns partition p's recorded maximum, 0 if none.
func (s *Sink) MaxEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error) {
	e, _, err := s.max(ctx, p)
	return e, err
}

func (s *Sink) max(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, string, error) {
	var e int64
	var holder string
	err := s.db.QueryRow(ctx, s.sqlMax, int32(p)).Scan(&e, &holder)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, "", nil
	}
	if err != nil {
		return 0, "", fmt.Errorf("pgsink: read the fence of partition %d: %w", p, describe(err))
	}
	return leasehold.Epoch(e), holder, nil
}

func (s *Sink) verify(ctx context.Context, st leasehold.Stamp, subject string) error {
	err := s.check.Check(ctx, st)
	if err == nil {
		return nil
	}
	o := sink.Failed
	if errors.Is(err, sink.ErrUnverifiedEpoch) {
		o = sink.Unverified
	}
	s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: st, Subject: subject, Err: err})
	return err
}

// stale builds and reports the error for a refused effect. The maximum is
// read after the refusal, for the message only.
func (s *Sink) stale(ctx context.Context, st leasehold.Stamp, subject string) error {
	max, holder, err := s.max(context.WithoutCancel(ctx), st.Partition)
	if err != nil || max <= st.Epoch {
		// The refusal is certain; only the details are missing.
		max = st.Epoch + 1
	}
	serr := sink.StaleError(st, max, holder)
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Stale, Stamp: st, Subject: subject, Max: max, Holder: holder, Err: serr})
	return serr
}

func (s *Sink) failed(ctx context.Context, st leasehold.Stamp, subject string, err error) error {
	err = fmt.Errorf("pgsink: apply %s (partition %d, epoch %d): %w", st.Key, st.Partition, st.Epoch, describe(err))
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: st, Subject: subject, Err: err})
	return err
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
		case strings.HasPrefix(pgErr.Code, "08"), strings.HasPrefix(pgErr.Code, "57"), strings.HasPrefix(pgErr.Code, "53"):
			return fmt.Errorf("PostgreSQL is restarting, shutting down or out of resources, so the write may or may not have happened; retry with the same idempotency key, which applies it at most once: %w", err)
		}
		return err
	}
	if pgconn.SafeToRetry(err) {
		return fmt.Errorf("PostgreSQL is unreachable, nothing was written; retry: %w", err)
	}
	return fmt.Errorf("PostgreSQL did not answer, so the write may or may not have happened; retry with the same idempotency key, which applies it at most once: %w", err)
}
