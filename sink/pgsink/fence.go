package pgsink

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// statements are the sink's SQL, built once for its tables.
type statements struct {
	fast    string // share-locked fence + effect, failing on a duplicate key
	one     string // fence upsert + effect, reporting both outcomes
	txFast  string // share-locked fence + key, for ApplyTx
	txRaise string // fence upsert + key, for ApplyTx
	advance string // fence upsert that only raises
	read    string // the fence's state
}

// admits is leasehold.Judge's admission rule over the stored row f and the
// proposed one: a higher epoch; or the same epoch from the same
// acquisition, or over a row that recorded none.
const admits = `f.epoch < EXCLUDED.epoch OR (f.epoch = EXCLUDED.epoch AND f.acquisition IN ('', EXCLUDED.acquisition))`

// raises is the part of admits that changes the fence: a higher epoch, or
// the first acquisition recorded at the epoch.
const raises = `f.epoch < EXCLUDED.epoch OR (f.epoch = EXCLUDED.epoch AND f.acquisition = '')`

// upsert writes a fence row where where holds, with the holder and the
// lock timeout in the given parameters ($1 scope, $2 partition, $3 epoch,
// $4 acquisition). The conflicting row is locked whether or not it is
// updated, until the transaction ends.
//
// The lock timeout is set for the statement's own transaction by the row
// source, which runs before the insert meets the conflicting row: a
// statement outside a transaction can be bounded no other way in one
// round trip, and the setting ends with the statement.
func upsert(fence, holder, lockTimeout, where string) string {
	return fmt.Sprintf(`INSERT INTO %[1]s AS f (scope, partition, epoch, acquisition, holder)
		SELECT $1, $2, $3, $4, %[2]s FROM (SELECT set_config('lock_timeout', %[3]s, true)) AS bounded
		ON CONFLICT (scope, partition) DO UPDATE
		SET epoch = EXCLUDED.epoch, acquisition = EXCLUDED.acquisition, holder = EXCLUDED.holder, updated_at = now()
		WHERE %[4]s
		RETURNING 1`, fence, holder, lockTimeout, where)
}

func newStatements(t Tables) statements {
	// A share lock where the fence holds exactly this epoch and
	// acquisition.
	shared := fmt.Sprintf(`SELECT 1 FROM %s WHERE scope = $1 AND partition = $2 AND epoch = $3 AND acquisition = $4 FOR SHARE`, t.Fence)
	return statements{
		fast: fmt.Sprintf(`WITH f AS (%s)
			INSERT INTO %s (scope, key, partition, epoch, subject, data, header)
			SELECT $1, $5, $2, $3, $6, $7, $8 FROM f`, shared, t.Effects),
		one: fmt.Sprintf(`WITH f AS (%s), e AS (
			INSERT INTO %s (scope, key, partition, epoch, subject, data, header)
			SELECT $1, $5, $2, $3, $6, $7, $8 FROM f
			ON CONFLICT (scope, key) DO NOTHING RETURNING 1)
			SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM e)`, upsert(t.Fence, "$9", "$10", admits), t.Effects),
		txFast: fmt.Sprintf(`WITH f AS (%s),
			k AS (INSERT INTO %s (scope, key, partition, epoch) SELECT $1, $5, $2, $3 FROM f ON CONFLICT (scope, key) DO NOTHING RETURNING 1)
			SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM k)`, shared, t.Keys),
		txRaise: fmt.Sprintf(`WITH f AS (%s), k AS (
			INSERT INTO %s (scope, key, partition, epoch) SELECT $1, $5, $2, $3 FROM f
			ON CONFLICT (scope, key) DO NOTHING RETURNING 1)
			SELECT (SELECT count(*) FROM f), (SELECT count(*) FROM k)`, upsert(t.Fence, "$6", "$7", admits), t.Keys),
		advance: upsert(t.Fence, "$5", "$6", raises),
		read:    fmt.Sprintf(`SELECT epoch, acquisition, holder FROM %s WHERE scope = $1 AND partition = $2`, t.Fence),
	}
}

// querier reads: the DB, or a transaction.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func (s *Sink) readFence(ctx context.Context, q querier, id leasehold.FenceID) (leasehold.FenceState, error) {
	var f leasehold.FenceState
	var e int64
	err := q.QueryRow(ctx, s.sql.read, id.Scope, int32(id.Partition)).Scan(&e, &f.Acquisition, &f.Holder)
	if errors.Is(err, pgx.ErrNoRows) {
		return leasehold.FenceState{}, nil
	}
	if err != nil {
		return leasehold.FenceState{}, err
	}
	f.Epoch = leasehold.Epoch(e)
	return f, nil
}

// refuse reads the fence of a write stamped st that its upsert refused,
// and reports and returns the refusal leasehold.Judge gives against it.
// Read through the transaction of the refusal, which holds the fence row
// locked, the state is the one that refused the write; read after the
// statement, the fence may have risen since, and the error names the newer
// state, which refuses the write too (a fence never goes back, and the
// acquisition recorded at an epoch does not change).
func (s *Sink) refuse(ctx context.Context, q querier, st leasehold.Stamp, subject string) error {
	f, err := s.readFence(context.WithoutCancel(ctx), q, st.Fence())
	v, _ := leasehold.Judge(f, st)
	if err != nil || v == leasehold.Admit {
		// The refusal is certain; only the details are missing.
		f, v = leasehold.FenceState{Epoch: st.Epoch + 1}, leasehold.Stale
	}
	return s.refused(ctx, st, subject, f, v)
}

// refused reports and returns the refusal of st by fence f with verdict v.
func (s *Sink) refused(ctx context.Context, st leasehold.Stamp, subject string, f leasehold.FenceState, v leasehold.Verdict) error {
	err := leasehold.Refusal(f, st, v)
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Refused(v), Stamp: st, Subject: subject,
		Max: f.Epoch, MaxAcquisition: f.Acquisition, Holder: f.Holder, Err: err})
	return err
}

// Advance raises l's fence to l's epoch and acquisition, recording
// l.Holder. It returns a *leasehold.StaleEpochError (wrapped) when the
// fence is above l's epoch, or at it for another acquisition; advancing
// again with the fence's own acquisition changes nothing.
func (s *Sink) Advance(ctx context.Context, l leasehold.Lease) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgsink: advance: %w", err)
	}
	if err := sink.ValidateAdvance(l); err != nil {
		return fmt.Errorf("pgsink: advance: %w", err)
	}
	st := sink.AdvanceStamp(l)
	if err := s.verify(ctx, st, ""); err != nil {
		return err
	}
	id := l.Fence()
	tag, err := s.db.Exec(ctx, s.sql.advance, l.Scope, int32(l.Partition), int64(l.Epoch), l.Acquisition, l.Holder, s.lockMs)
	if err != nil {
		return fmt.Errorf("pgsink: advance %s to epoch %d: %w", id, l.Epoch, s.describe(err, id))
	}
	if tag.RowsAffected() > 0 {
		s.rep.Report(ctx, sink.Decision{Outcome: sink.Advanced, Stamp: st, Max: l.Epoch, MaxAcquisition: l.Acquisition})
		return nil
	}
	// Nothing changed: the fence holds this acquisition already, or
	// refuses it.
	f, err := s.readFence(ctx, s.db, id)
	if err != nil {
		return fmt.Errorf("pgsink: advance %s to epoch %d: %w", id, l.Epoch, s.describe(err, id))
	}
	v, _ := leasehold.Judge(f, st)
	if v == leasehold.Admit {
		return nil
	}
	return fmt.Errorf("pgsink: advance: %w", s.refused(ctx, st, "", f, v))
}

// Fence returns what the sink records for id: the zero FenceState if
// nothing.
func (s *Sink) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	if err := ctx.Err(); err != nil {
		return leasehold.FenceState{}, fmt.Errorf("pgsink: read the fence of %s: %w", id, err)
	}
	f, err := s.readFence(ctx, s.db, id)
	if err != nil {
		return leasehold.FenceState{}, fmt.Errorf("pgsink: read the fence of %s: %w", id, s.describe(err, id))
	}
	return f, nil
}
