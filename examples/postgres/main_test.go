package main

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testskip"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/testing/pgtest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(testskip.Summarize(m)) }

// The example runs to the end against a real PostgreSQL (skipped without
// one unless LEASEHOLD_REQUIRE_POSTGRES=1) on a given NATS server, then on
// its own; each time worker-a's late transaction was refused and the
// tables, read here, hold each order paid once, o-2 by worker-b.
func TestLateTransactionRefused(t *testing.T) {
	t.Parallel()
	dsn := pgtest.Start(t).CreateDatabase(t, "shop")
	srv := natstest.Start(t, natstest.Listen())
	for _, url := range []string{srv.URL(), ""} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var out bytes.Buffer
		refused, err := run(ctx, &out, options{nats: url, postgres: dsn})
		if err != nil {
			t.Fatalf("run: %v\n%s", err, out.String())
		}
		t.Log("\n" + out.String())
		if refused == nil || refused.Worker != "worker-a" || refused.Max <= refused.Epoch || !errors.Is(refused, leasehold.ErrStaleEpoch) {
			t.Errorf("refused with %v, want worker-a's epoch below a higher one", refused)
		}
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var payments, paid, balance int64
		var by string
		if err := conn.QueryRow(ctx, `SELECT (SELECT sum(payments) FROM leasehold_example.orders), (SELECT sum(cents) FROM leasehold_example.orders WHERE payments = 1),
			(SELECT paid_by FROM leasehold_example.orders WHERE id = 'o-2'), (SELECT balance_cents FROM leasehold_example.accounts)`).Scan(&payments, &paid, &by, &balance); err != nil {
			t.Fatal(err)
		}
		if payments != 3 || paid != 6000 || balance != 6000 || by != "worker-b" {
			t.Errorf("%d payments, %d cents of orders paid once, balance %d, o-2 paid by %s: want 3, 6000, 6000, worker-b", payments, paid, balance, by)
		}
	}
}

// A schema the example did not create is never dropped.
func TestForeignSchemaKept(t *testing.T) {
	t.Parallel()
	dsn := pgtest.Start(t).CreateDatabase(t, "shop")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE SCHEMA leasehold_example; CREATE TABLE leasehold_example.precious (x int)`); err != nil {
		t.Fatal(err)
	}
	if _, err := run(ctx, &bytes.Buffer{}, options{postgres: dsn}); err == nil {
		t.Fatal("run over a foreign schema: no error")
	}
	if _, err := conn.Exec(ctx, `SELECT * FROM leasehold_example.precious`); err != nil {
		t.Fatalf("the foreign table is gone: %v", err)
	}
}
