package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/testing/pgtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The example against an embedded NATS server and a real PostgreSQL: what
// it prints, and what the tables hold afterwards.
func TestExample(t *testing.T) {
	nats := natstest.Start(t, natstest.Listen())
	pg := pgtest.Start(t)
	dsn := pg.CreateDatabase(t, "shop")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := config{NATS: nats.URL(), Postgres: dsn, Partitions: 4, Jobs: 20}
	var out bytes.Buffer
	if err := run(ctx, &out, cfg); err != nil {
		t.Fatalf("run: %v\noutput:\n%s", err, out.String())
	}
	text := out.String()
	t.Log("\n" + text)

	// Orders go to partition (N-1) mod 4: partition 0 has o-1, o-5, o-9,
	// o-13, o-17, and worker-a freezes in the middle one, o-9.
	m := regexp.MustCompile(`It holds the job's stamp: partition 0, epoch (\d+), key (\S+),`).FindStringSubmatch(text)
	if m == nil {
		t.Fatal("the output does not show the frozen stamp")
	}
	e1, err := leasehold.ParseEpoch(m[1])
	if err != nil {
		t.Fatal(err)
	}
	m = regexp.MustCompile(`worker-b holds partition 0 at epoch (\d+) > worker-a's`).FindStringSubmatch(text)
	if m == nil {
		t.Fatal("the output does not show worker-b's epoch")
	}
	e2, err := leasehold.ParseEpoch(m[1])
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"worker-a pays 17 orders, then freezes in the middle of order o-9 (partition 0)",
		"refused: leasehold: scope orders partition 0: epoch " + e1.String() + " is below the recorded " + e2.String() +
			": worker worker-a lost its lease and the write was not applied",
		"errors.Is(err, leasehold.ErrStaleEpoch) = true",
		"worker-b paid o-9, o-13, o-17,",
		"order o-9: paid, payments = 1, paid by worker-b under epoch " + e2.String(),
		"orders: 20 of 20 paid; 20 paid exactly once (payments = 1)",
		"leasehold_fence: partition 0 at epoch " + e2.String(),
		"stale transactions refused: 1 (partition 0)",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the output lacks %q", want)
		}
	}
	if strings.Contains(text, "NOT equal") {
		t.Error("the merchant's balance is not the sum of the orders")
	}

	// The tables, read without the program's help.
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT id, partition, status, payments, paid_by, paid_epoch FROM leasehold_example.orders`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		ID        string
		Partition int32
		Status    string
		Payments  int
		By        string
		Epoch     int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 20 {
		t.Fatalf("%d orders, want 20", len(got))
	}
	byB := map[string]bool{"o-9": true, "o-13": true, "o-17": true}
	for _, r := range got {
		if r.Status != "paid" || r.Payments != 1 {
			t.Errorf("order %s: %s with %d payments, want paid once", r.ID, r.Status, r.Payments)
		}
		switch {
		case byB[r.ID]:
			if r.By != "worker-b" || leasehold.Epoch(r.Epoch) != e2 {
				t.Errorf("order %s paid by %s under %d, want worker-b under %d", r.ID, r.By, r.Epoch, e2)
			}
		case r.By != "worker-a":
			t.Errorf("order %s paid by %s, want worker-a (which paid it before it froze)", r.ID, r.By)
		case r.Partition == 0 && leasehold.Epoch(r.Epoch) != e1:
			t.Errorf("order %s paid under epoch %d, want worker-a's %d", r.ID, r.Epoch, e1)
		}
	}
	var balance, sum int64
	if err := conn.QueryRow(ctx, `SELECT (SELECT balance_cents FROM leasehold_example.accounts WHERE id = 'merchant'), (SELECT sum(cents) FROM leasehold_example.orders)`).Scan(&balance, &sum); err != nil {
		t.Fatal(err)
	}
	if balance != sum {
		t.Errorf("merchant balance %d, want the sum of the orders %d", balance, sum)
	}
	var keys int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM leasehold_example.leasehold_keys`).Scan(&keys); err != nil {
		t.Fatal(err)
	}
	if keys != 20 {
		t.Errorf("%d idempotency keys recorded, want one per order: 20", keys)
	}

	// A second run on the same servers starts over: the schema it created
	// is dropped, the old jobs are purged.
	out.Reset()
	if err := run(ctx, &out, cfg); err != nil {
		t.Fatalf("second run: %v\noutput:\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "orders: 20 of 20 paid; 20 paid exactly once") {
		t.Errorf("second run:\n%s", out.String())
	}
}

func TestBadConfig(t *testing.T) {
	err := run(context.Background(), &bytes.Buffer{}, config{Partitions: -1, Prefix: "a.b", Schema: "Shop"})
	if err == nil {
		t.Fatal("want an error")
	}
	for _, want := range []string{"no PostgreSQL: pass -postgres", "-partitions -1", `-prefix "a.b"`, `-schema "Shop"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

// A schema the example did not create is never dropped.
func TestForeignSchema(t *testing.T) {
	pg := pgtest.Start(t)
	dsn := pg.CreateDatabase(t, "shop")
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
	nats := natstest.Start(t, natstest.Listen())
	err = run(ctx, &bytes.Buffer{}, config{NATS: nats.URL(), Postgres: dsn})
	if err == nil || !strings.Contains(err.Error(), "was not created by this example") || !strings.Contains(err.Error(), "pass -schema") {
		t.Fatalf("run over a foreign schema: %v", err)
	}
	if _, err := conn.Exec(ctx, `SELECT * FROM leasehold_example.precious`); err != nil {
		t.Fatalf("the foreign table is gone: %v", err)
	}
}
