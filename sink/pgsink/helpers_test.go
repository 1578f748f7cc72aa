package pgsink_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/internal/testskip"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// Set-up the tests of this package share: a PostgreSQL server and a pool
// on it, sinks on that pool, leases and what a sink applied.

// Each test has a server of its own, and most of their time is
// PostgreSQL's start and lock waits: run more of them at once than the two
// a two-core machine gets by default.
func TestMain(m *testing.M) {
	testpar.Raise(4)
	testleak.VerifyTestMain(testskip.Summarize(m))
}

// startDB starts a PostgreSQL server of the test's own and a pool on its
// database.
func startDB(t testing.TB) (*pgtest.Server, *pgxpool.Pool) {
	t.Helper()
	srv := pgtest.Start(t)
	return srv, pool(t, srv.DSN())
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func pool(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 16
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func newSink(t testing.TB, db pgsink.DB, cfg pgsink.Config) *pgsink.Sink {
	t.Helper()
	cfg.DB = db
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	if err := pgsink.CreateSchema(ctxFor(t, time.Minute), db, cfg); err != nil {
		t.Fatal(err)
	}
	s, err := pgsink.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func applied(ctx context.Context, db pgsink.DB, s *pgsink.Sink) ([]sink.Effect, error) {
	rows, err := db.Query(ctx, "SELECT scope, key, partition, epoch, subject, data FROM "+s.Tables().Effects)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []sink.Effect
	for rows.Next() {
		var e sink.Effect
		var p int32
		var ep int64
		if err := rows.Scan(&e.Stamp.Scope, &e.Stamp.Key, &p, &ep, &e.Subject, &e.Data); err != nil {
			return nil, err
		}
		e.Stamp.Partition, e.Stamp.Epoch = leasehold.Partition(p), leasehold.Epoch(ep)
		out = append(out, e)
	}
	return out, rows.Err()
}

// lease is the acquisition of epoch e of partition p in scope, with the
// acquisition token acq(e) and the holder "w<e>".
func lease(scope string, p leasehold.Partition, e leasehold.Epoch) leasehold.Lease {
	return leasehold.Lease{Scope: scope, Partition: p, Epoch: e, Acquisition: acq(e), Holder: "w" + e.String()}
}

func acq(e leasehold.Epoch) string { return "acq" + e.String() }

func stampOf(l leasehold.Lease, key string) leasehold.Stamp { return l.Stamp(key) }

// waitLockWaiters waits until PostgreSQL reports n sessions waiting for a
// lock. A value on returned (optional) means a call that should be waiting
// returned instead.
func waitLockWaiters(ctx context.Context, t *testing.T, db pgsink.DB, n int, returned <-chan error) {
	t.Helper()
	for {
		var waiting int
		if err := db.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting >= n {
			return
		}
		select {
		case err := <-returned:
			t.Fatalf("a call returned (%v) while it should wait for the fence row (%d of %d sessions wait)", err, waiting, n)
		case <-ctx.Done():
			t.Fatalf("waiting for %d sessions to wait for a lock: %d do", n, waiting)
		case <-time.After(10 * time.Millisecond):
		}
	}
}
