package httpsink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// PostgresDB is what PostgresKeys needs of a database handle:
// *pgxpool.Pool fits.
type PostgresDB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// PostgresKeysConfig configures a PostgresKeys store.
type PostgresKeysConfig struct {
	// Schema holds the table. Default: the connection's search path.
	Schema string
	// Table is the table's name. Default "leasehold_http_keys".
	Table string
}

// PostgresKeys keeps idempotency keys in a PostgreSQL table, one row per
// key. A claim is one statement: an insert that, on a key already there,
// takes the row over only where it has expired. Done and Release are
// updates and deletes that match the claim's token. Rows expired for a
// minute are removed, a thousand at a time, at most once a minute, by the
// claim that finds it due.
//
// Keep the fences in the same database with pgsink (pgsink.New with
// pgsink.CreateSchema) as the Verifier's Fences.
type PostgresKeys struct {
	db                             PostgresDB
	claim, read, done, release, gc string

	mu     sync.Mutex
	lastGC time.Time
}

const keysDDL = `CREATE TABLE IF NOT EXISTS %s (
	key        text        PRIMARY KEY,
	sum        bytea       NOT NULL,
	status     integer     NOT NULL DEFAULT 0,
	token      text        NOT NULL,
	expires_at timestamptz NOT NULL
)`

// NewPostgresKeys creates the table if it does not exist.
func NewPostgresKeys(ctx context.Context, db PostgresDB, cfg PostgresKeysConfig) (*PostgresKeys, error) {
	if cfg.Table == "" {
		cfg.Table = "leasehold_http_keys"
	}
	t := pgx.Identifier{cfg.Table}.Sanitize()
	if cfg.Schema != "" {
		t = pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	}
	if _, err := db.Exec(ctx, fmt.Sprintf(keysDDL, t)); err != nil {
		var pe *pgconn.PgError
		// Two processes creating the table at once: the loser finds it.
		if !errors.As(err, &pe) || (pe.Code != "23505" && pe.Code != "42P07") {
			return nil, fmt.Errorf("httpsink: create the key table %s: %w", t, err)
		}
	}
	return &PostgresKeys{
		db: db,
		claim: fmt.Sprintf(`INSERT INTO %s AS k (key, sum, status, token, expires_at)
			VALUES ($1, $2, 0, $3, now() + make_interval(secs => $4))
			ON CONFLICT (key) DO UPDATE SET sum = EXCLUDED.sum, status = 0, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
			WHERE k.expires_at <= now()
			RETURNING 1`, t),
		read:    fmt.Sprintf(`SELECT sum, status, token FROM %s WHERE key = $1 AND expires_at > now()`, t),
		done:    fmt.Sprintf(`UPDATE %s SET status = $3, expires_at = now() + make_interval(secs => $4) WHERE key = $1 AND token = $2 AND status = 0`, t),
		release: fmt.Sprintf(`DELETE FROM %s WHERE key = $1 AND token = $2 AND status = 0`, t),
		gc:      fmt.Sprintf(`DELETE FROM %[1]s WHERE ctid IN (SELECT ctid FROM %[1]s WHERE expires_at < now() - interval '1 minute' LIMIT 1000)`, t),
	}, nil
}

// Claim implements Keys.
func (p *PostgresKeys) Claim(ctx context.Context, key string, sum [32]byte, hold time.Duration) (Claim, error) {
	p.collect(ctx)
	token := newToken()
	for attempt := 0; attempt < 5; attempt++ {
		var one int
		err := p.db.QueryRow(ctx, p.claim, key, sum[:], token, hold.Seconds()).Scan(&one)
		if err == nil {
			return Claim{Key: key, Won: true, Sum: sum, Token: token}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Claim{}, fmt.Errorf("httpsink: claim idempotency key: %w", err)
		}
		c := Claim{Key: key}
		var s []byte
		err = p.db.QueryRow(ctx, p.read, key).Scan(&s, &c.Status, &c.Token)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // expired or released in between: claim again
		}
		if err != nil {
			return Claim{}, fmt.Errorf("httpsink: read idempotency key: %w", err)
		}
		copy(c.Sum[:], s)
		return c, nil
	}
	return Claim{}, errors.New("httpsink: claim idempotency key: it kept changing")
}

// Done implements Keys.
func (p *PostgresKeys) Done(ctx context.Context, c Claim, status int, keep time.Duration) error {
	tag, err := p.db.Exec(ctx, p.done, c.Key, c.Token, status, keep.Seconds())
	if err != nil {
		return fmt.Errorf("httpsink: record idempotency key: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return ErrClaimLost
	}
	return nil
}

// Release implements Keys.
func (p *PostgresKeys) Release(ctx context.Context, c Claim) error {
	tag, err := p.db.Exec(ctx, p.release, c.Key, c.Token)
	if err != nil {
		return fmt.Errorf("httpsink: release idempotency key: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return ErrClaimLost
	}
	return nil
}

// collect removes expired rows when a minute has passed since it last did.
func (p *PostgresKeys) collect(ctx context.Context) {
	p.mu.Lock()
	due := time.Since(p.lastGC) >= time.Minute
	if due {
		p.lastGC = time.Now()
	}
	p.mu.Unlock()
	if due {
		_, _ = p.db.Exec(ctx, p.gc)
	}
}
