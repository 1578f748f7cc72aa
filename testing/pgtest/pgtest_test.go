package pgtest_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testskip"
	"github.com/leasehold/leasehold/testing/pgtest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(testskip.Summarize(m)) }

func TestRestartKeepsData(t *testing.T) {
	t.Parallel()
	s := pgtest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := s.CreateDatabase(t, "kept")
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "CREATE TABLE t (v int); INSERT INTO t VALUES (42)"); err != nil {
		t.Fatal(err)
	}
	c.Close(ctx)
	s.Restart(t)
	c, err = pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	var v int
	if err := c.QueryRow(ctx, "SELECT v FROM t").Scan(&v); err != nil || v != 42 {
		t.Fatalf("after restart: %d, %v", v, err)
	}
	s.Stop()
	if s.Running() {
		t.Fatal("still running after Stop")
	}
	if _, err := pgx.Connect(ctx, dsn); err == nil {
		t.Fatal("connected to a stopped server")
	}
}

// Servers are copies of one cluster initdb made once: each is its own,
// and what one stores the other does not see.
func TestServersAreIndependent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, b := pgtest.Start(t), pgtest.Start(t)
	if a.Port() == b.Port() {
		t.Fatalf("two servers on port %d", a.Port())
	}
	ca, err := pgx.Connect(ctx, a.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Close(ctx)
	if _, err := ca.Exec(ctx, "CREATE TABLE only_in_a (v int)"); err != nil {
		t.Fatal(err)
	}
	cb, err := pgx.Connect(ctx, b.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Close(ctx)
	var n int
	if err := cb.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_a'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("the other server sees %d tables only_in_a (%v)", n, err)
	}
}
