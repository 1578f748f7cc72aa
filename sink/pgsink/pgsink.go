// Package pgsink is a leasehold sink that writes to PostgreSQL (pgx v5).
//
// A fence is a row keyed by (scope, partition) that records the highest
// epoch accepted, the acquisition it came from and its holder; effects and
// ApplyTx keys are keyed by (scope, idempotency key). Any number of job
// streams and locks share one database and one set of tables: a fence
// orders the holders of its own scope and nothing else.
//
// The fence, the dedupe and the effect are one statement. Raising a fence
// is an upsert of its row that only matches when leasehold.Judge would
// admit the effect (INSERT ... ON CONFLICT ... DO UPDATE ... WHERE the
// stored epoch is lower, or equal and from the same acquisition or from
// none recorded), feeding an insert of the effect keyed by its
// idempotency key; the upsert locks the fence row whether or not it
// updates it, so no newer epoch can be recorded between the check and the
// write, and a refused effect writes nothing. A refusal says whether the
// effect was stale or a split-brain write (its epoch recorded for another
// acquisition).
//
// Most effects carry the epoch and acquisition already recorded, and for
// them the sink takes a cheaper path: a FOR SHARE lock on the fence row
// where it holds exactly those, feeding the insert. A raise (the upsert's
// DO UPDATE, or Advance) needs the row's update lock, which waits for every
// share lock's transaction to end; and a share lock taken after a raise
// committed re-reads the row (READ COMMITTED re-checks a locked row's
// newest version) and no longer matches. So an effect written under the
// share lock commits before any raise, and none lands after one. Writers
// of the same epoch share the lock and do not wait for each other. A
// fenced write costs about what a plain upsert does (see
// BenchmarkFencedVsPlain).
//
// A batch is one transaction.
//
// ApplyTx runs a handler's own SQL in the same fenced transaction: the
// fence row stays locked until the transaction ends. A raise waits for
// such transactions, so it waits for the fence row at most
// Config.LockTimeout (then fails with an error matching ErrFenceLocked,
// having written nothing), and PostgreSQL ends a sink transaction left
// idle for Config.TxIdleTimeout: a holder paused inside ApplyTx holds its
// successor up for a bounded time.
//
// Tables are created by CreateSchema; their names are Config.Prefix
// followed by fence, effects and keys. CreateSchema upgrades tables created
// before fence scopes in place, given the scope that wrote them
// (Config.LegacyScope).
package pgsink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"time"

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
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
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
	// LegacyScope is the scope that wrote tables created before fence
	// scopes: normally the job stream's prefix (the Leasehold-Scope its
	// workers stamp now). CreateSchema upgrades such tables in place when
	// it is set, giving all their rows this scope, and refuses them
	// (ErrLegacySchema) when it is not. Current tables ignore it.
	LegacyScope string
	// LockTimeout bounds how long a statement that raises a fence (a new
	// holder's first write, or Advance) waits for the fence row's lock
	// (PostgreSQL's lock_timeout). A raise waits for the transactions
	// writing under the previous epoch to end, and a holder paused inside
	// ApplyTx would hold it up for as long as the pause lasts; past the
	// bound the write changes nothing and returns an error matching
	// ErrFenceLocked, and may be retried. Transactions of ApplyTx and of
	// batches run under it as a whole, fn's statements included: they hold
	// the fence row while they wait. (A write at the fence's own epoch,
	// outside a transaction, shares the row's lock and waits only for a
	// transaction holding the row exclusively: a batch, or an ApplyTx that
	// raised it, which TxIdleTimeout bounds when its client is paused.)
	// Default 5 s; negative means no bound.
	LockTimeout time.Duration
	// TxIdleTimeout ends a transaction of the sink (ApplyTx, a batch) that
	// stays idle longer than this: PostgreSQL's
	// idle_in_transaction_session_timeout, for that transaction alone. A
	// holder paused inside ApplyTx then loses its transaction, and the
	// fence row's lock with it, instead of holding up its successor for as
	// long as it is paused; its ApplyTx returns an error and wrote nothing.
	// fn must not spend longer than this outside the database. Default
	// 10 s (the lease TTL's default); negative means no bound.
	TxIdleTimeout time.Duration
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

// Defaults of the Config fields that bound waits.
const (
	DefaultLockTimeout   = 5 * time.Second
	DefaultTxIdleTimeout = 10 * time.Second
)

func (c *Config) setDefaults() {
	if c.Prefix == "" {
		c.Prefix = "leasehold_"
	}
	if c.Name == "" {
		c.Name = "postgres"
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	if c.TxIdleTimeout == 0 {
		c.TxIdleTimeout = DefaultTxIdleTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
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
	if c.LegacyScope != "" {
		if err := leasehold.ValidateScope(c.LegacyScope); err != nil {
			errs = append(errs, fmt.Errorf("legacy scope %q: %w", c.LegacyScope, err))
		}
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

// millis renders a bound as PostgreSQL's integer milliseconds, "0" (no
// bound) for a negative one; a positive bound is at least 1 ms.
func millis(d time.Duration) string {
	if d < 0 {
		return "0"
	}
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10)
}

// Sink is a fenced PostgreSQL sink. It is safe for concurrent use.
type Sink struct {
	db          DB
	t           Tables
	rep         *sink.Reporter
	log         *slog.Logger
	check       *sink.EpochCheck
	pkey        string // the effects table's primary key constraint
	lockTimeout time.Duration
	lockMs      string        // LockTimeout for set_config
	txOpts      pgx.TxOptions // begins a transaction under both bounds
	sql         statements
}

var _ sink.Sink = (*Sink)(nil)

// New returns a sink over tables CreateSchema has created.
func New(cfg Config) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("pgsink: invalid config: %w", err)
	}
	cfg.setDefaults()
	t := tablesFor(cfg.Schema, cfg.Prefix)
	return &Sink{
		db:          cfg.DB,
		t:           t,
		rep:         sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		log:         cfg.Logger,
		check:       sink.NewEpochCheck(cfg.Verifier),
		pkey:        pkeyName(cfg.Prefix, "effects"),
		lockTimeout: cfg.LockTimeout,
		lockMs:      millis(cfg.LockTimeout),
		txOpts: pgx.TxOptions{BeginQuery: fmt.Sprintf("BEGIN; SET LOCAL lock_timeout = %s; SET LOCAL idle_in_transaction_session_timeout = %s",
			millis(cfg.LockTimeout), millis(cfg.TxIdleTimeout))},
		sql: newStatements(t),
	}, nil
}

// Tables returns the table names, quoted for SQL.
func (s *Sink) Tables() Tables { return s.t }

// Dropped returns how many effects of fence id were refused.
func (s *Sink) Dropped(id leasehold.FenceID) uint64 { return s.rep.Dropped(id) }

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
	for attempt := 1; ; attempt++ {
		var err error
		if len(effects) == 1 {
			err = s.applyOne(ctx, &effects[0])
		} else {
			err = s.applyBatch(ctx, effects)
		}
		if attempt == maxRollbackRetries || !rolledBack(err) || ctx.Err() != nil {
			return err
		}
		s.log.Warn("pgsink: PostgreSQL rolled the write back to break a deadlock or a serialization conflict with another writer; nothing of it was written: trying again",
			"scope", effects[0].Stamp.Scope, "partition", effects[0].Stamp.Partition, "effects", len(effects), "attempt", attempt, "err", err)
	}
}

// maxRollbackRetries bounds how often Apply writes again after PostgreSQL
// rolled its transaction back to break a deadlock or a serialization
// conflict. Two batches whose effects share idempotency keys across
// partitions can lock a fence row and a key in opposite orders; PostgreSQL
// fails one after deadlock_timeout, which wrote nothing, and the next try
// finds the other committed.
const maxRollbackRetries = 3

// rolledBack reports whether err is PostgreSQL's rollback of a deadlock
// victim (40P01) or a serialization failure (40001): the statement or
// transaction wrote nothing, and trying again is safe.
func rolledBack(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001")
}

// applyOne is the common case: one statement that share-locks the fence
// row where it holds the effect's epoch and acquisition, and inserts the
// effect. Its insert has no ON CONFLICT clause, so that the command tag
// alone says what happened: one row is an applied effect; no row means the
// fence does not hold this epoch and acquisition (no fence yet, one to
// raise, or one that refuses), and the statement changed nothing; and a
// duplicate key fails the statement with a unique violation, which only
// the insert can raise, after the fence row matched and was locked: the
// effect is admitted, and was applied before.
func (s *Sink) applyOne(ctx context.Context, e *sink.Effect) error {
	tag, err := s.db.Exec(ctx, s.sql.fast, s.fastArgs(e)...)
	switch {
	case err == nil && tag.RowsAffected() == 1:
		s.report(ctx, e, true)
		return nil
	case err == nil:
		return s.applyUpsert(ctx, e)
	case s.isDuplicate(err):
		s.report(ctx, e, false)
		return nil
	}
	return s.failed(ctx, e.Stamp, e.Subject, err)
}

// applyUpsert raises the fence, or refuses the effect, and applies it if
// admitted, in one statement.
func (s *Sink) applyUpsert(ctx context.Context, e *sink.Effect) error {
	var fenced, inserted int
	if err := s.db.QueryRow(ctx, s.sql.one, s.upsertArgs(e)...).Scan(&fenced, &inserted); err != nil {
		return s.failed(ctx, e.Stamp, e.Subject, err)
	}
	if fenced == 0 {
		return s.refuse(ctx, s.db, e.Stamp, e.Subject)
	}
	s.report(ctx, e, inserted == 1)
	return nil
}

func (s *Sink) isDuplicate(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == s.pkey
}

// fastArgs are the arguments of statements.fast: $1 scope, $2 partition,
// $3 epoch, $4 acquisition, $5 key, $6 subject, $7 data, $8 header.
func (s *Sink) fastArgs(e *sink.Effect) []any {
	var header []byte
	if len(e.Header) > 0 {
		header, _ = json.Marshal(e.Header)
	}
	st := &e.Stamp
	return []any{st.Scope, int32(st.Partition), int64(st.Epoch), st.Acquisition, st.Key, e.Subject, e.Data, header}
}

// upsertArgs are the arguments of statements.one: fastArgs, then $9 the
// worker (the holder a raise records) and $10 the lock timeout.
func (s *Sink) upsertArgs(e *sink.Effect) []any {
	return append(s.fastArgs(e), e.Stamp.Worker, s.lockMs)
}

// report reports an admitted effect: applied, or a duplicate.
func (s *Sink) report(ctx context.Context, e *sink.Effect, applied bool) {
	o := sink.Accepted
	if !applied {
		o = sink.Duplicate
	}
	s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: e.Stamp, Subject: e.Subject, Max: e.Stamp.Epoch, MaxAcquisition: e.Stamp.Acquisition})
}

func (s *Sink) applyBatch(ctx context.Context, effects []sink.Effect) (err error) {
	tx, err := s.db.BeginTx(ctx, s.txOpts)
	if err != nil {
		return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	b := &pgx.Batch{}
	locks := s.fenceLocks(effects)
	for _, k := range locks {
		b.Queue(lockFence, k)
	}
	for i := range effects {
		b.Queue(s.sql.one, s.upsertArgs(&effects[i])...)
	}
	res := tx.SendBatch(ctx, b)
	for range locks {
		if _, err := res.Exec(); err != nil {
			res.Close()
			return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
		}
	}
	inserted := make([]int, len(effects))
	fenced := make([]int, len(effects))
	refusedAt := -1
	for i := range effects {
		if err := res.QueryRow().Scan(&fenced[i], &inserted[i]); err != nil {
			res.Close()
			return s.failed(ctx, effects[i].Stamp, effects[i].Subject, err)
		}
		if fenced[i] == 0 && refusedAt < 0 {
			refusedAt = i
		}
	}
	if err := res.Close(); err != nil {
		return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
	}
	if refusedAt >= 0 {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		rerr := s.refuseInBatch(ctx, effects, fenced, refusedAt)
		return fmt.Errorf("pgsink: effect %d of %d: %w (no effect of the batch was applied)", refusedAt+1, len(effects), rerr)
	}
	if err := tx.Commit(ctx); err != nil {
		return s.failed(ctx, effects[0].Stamp, effects[0].Subject, err)
	}
	for i := range effects {
		s.report(ctx, &effects[i], inserted[i] == 1)
	}
	return nil
}

// lockFence takes a transaction's advisory lock on one fence.
const lockFence = `SELECT pg_advisory_xact_lock($1)`

// fenceLocks returns the advisory lock keys of the fences of a batch that
// touches more than one, in ascending order. A batch locks its fence rows
// in the order of its effects, so two batches that name two fences in
// opposite orders would each hold one row and wait for the other, until
// PostgreSQL broke the deadlock by failing one (SQLSTATE 40P01). Taking
// the fences' advisory locks first, in one order for everyone, makes the
// second batch wait for the first instead, and keeps the effects in the
// order given. A batch of one fence, like a single effect, locks one row
// and needs none.
func (s *Sink) fenceLocks(effects []sink.Effect) []int64 {
	seen := map[leasehold.FenceID]bool{}
	var keys []int64
	for i := range effects {
		id := effects[i].Stamp.Fence()
		if seen[id] {
			continue
		}
		seen[id] = true
		h := fnv.New64a()
		h.Write([]byte(s.t.Fence))
		h.Write([]byte{0})
		h.Write([]byte(id.Scope))
		h.Write([]byte{0})
		h.Write([]byte(id.Partition.String()))
		keys = append(keys, int64(h.Sum64()))
	}
	if len(keys) < 2 {
		return nil
	}
	slices.Sort(keys)
	return slices.Compact(keys)
}

// refuseInBatch reports and returns the refusal of effects[i] by its
// batch. The fence that refused it is the one the batch's earlier effects
// of that fence left, when one was admitted, and the recorded one when none
// was. It is not the row as the transaction left it: a later effect of the
// batch may have raised it, and that raise was rolled back with the rest.
// The recorded fence is read after the rollback, and may have risen since:
// it refuses the effect too (see refuse).
func (s *Sink) refuseInBatch(ctx context.Context, effects []sink.Effect, fenced []int, i int) error {
	e := &effects[i]
	for j := i - 1; j >= 0; j-- {
		prev := &effects[j].Stamp
		if prev.Fence() != e.Stamp.Fence() || fenced[j] == 0 {
			continue
		}
		f := leasehold.FenceState{Epoch: prev.Epoch, Acquisition: prev.Acquisition, Holder: prev.Worker}
		if v, _ := leasehold.Judge(f, e.Stamp); v != leasehold.Admit {
			return s.refused(ctx, e.Stamp, e.Subject, f, v)
		}
		break
	}
	return s.refuse(ctx, s.db, e.Stamp, e.Subject)
}

// verify checks, before the statement, that the lease bucket issued st's
// epoch to its fence for its acquisition (see sink.EpochCheck). Every
// stamp is checked, not only those that raise the fence: the fence is
// read and raised in the statement, one round trip, and a stamp that
// raises nothing is the fence's own (epoch, acquisition), verified and
// cached when it raised it, or a refusal either way.
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

func (s *Sink) failed(ctx context.Context, st leasehold.Stamp, subject string, err error) error {
	err = fmt.Errorf("pgsink: apply %s (scope %s partition %d, epoch %d): %w", st.Key, st.Scope, st.Partition, st.Epoch, s.describe(err, st.Fence()))
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: st, Subject: subject, Err: err})
	return err
}
