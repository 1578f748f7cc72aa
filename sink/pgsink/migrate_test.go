package pgsink_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// legacyDDL is CreateSchema's DDL before fence scopes, as it was: fence
// rows keyed by partition, effects and keys by idempotency key alone.
const legacyDDL = `
CREATE TABLE IF NOT EXISTS %[1]s (
	partition  integer     PRIMARY KEY CHECK (partition >= 0),
	epoch      bigint      NOT NULL CHECK (epoch > 0),
	holder     text        NOT NULL DEFAULT '',
	updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS %[2]s (
	key        text        PRIMARY KEY,
	partition  integer     NOT NULL,
	epoch      bigint      NOT NULL,
	subject    text        NOT NULL,
	data       bytea,
	header     jsonb,
	applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS %[3]s (
	key        text        PRIMARY KEY,
	partition  integer     NOT NULL,
	epoch      bigint      NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now()
);`

// legacyTables creates the tables of a sink from before fence scopes and
// writes into them what that sink wrote, with its statements: partition
// 0 fenced at epoch 40 by w40, partition 1 at 7; two effects, and one
// ApplyTx key.
func legacyTables(ctx context.Context, t *testing.T, db pgsink.DB, schema, prefix string) pgsink.Tables {
	t.Helper()
	name := func(n string) string {
		if schema != "" {
			return pgx.Identifier{schema, prefix + n}.Sanitize()
		}
		return pgx.Identifier{prefix + n}.Sanitize()
	}
	tb := pgsink.Tables{Fence: name("fence"), Effects: name("effects"), Keys: name("keys")}
	ddl := fmt.Sprintf(legacyDDL, tb.Fence, tb.Effects, tb.Keys)
	if schema != "" {
		ddl = "CREATE SCHEMA IF NOT EXISTS " + pgx.Identifier{schema}.Sanitize() + ";" + ddl
	}
	stmts := []struct {
		sql  string
		args []any
	}{
		{ddl, nil},
		{`INSERT INTO ` + tb.Fence + ` AS f (partition, epoch, holder) VALUES ($1, $2, $3)
			ON CONFLICT (partition) DO UPDATE SET epoch = EXCLUDED.epoch, holder = EXCLUDED.holder, updated_at = now()
			WHERE f.epoch < EXCLUDED.epoch`, []any{int32(0), int64(40), "w40"}},
		{`INSERT INTO ` + tb.Fence + ` (partition, epoch, holder) VALUES ($1, $2, $3)`, []any{int32(1), int64(7), "w7"}},
		{`INSERT INTO ` + tb.Effects + ` (key, partition, epoch, subject, data, header) VALUES ($1, $2, $3, $4, $5, $6)`,
			[]any{"orders.0.1.0", int32(0), int64(40), "s", []byte("old data"), nil}},
		{`INSERT INTO ` + tb.Effects + ` (key, partition, epoch, subject, data, header) VALUES ($1, $2, $3, $4, $5, $6)`,
			[]any{"orders.1.1.0", int32(1), int64(7), "s", []byte("old data"), nil}},
		{`INSERT INTO ` + tb.Keys + ` (key, partition, epoch) VALUES ($1, $2, $3)`, []any{"orders.0.2.0", int32(0), int64(40)}},
	}
	for _, st := range stmts {
		if _, err := db.Exec(ctx, st.sql, st.args...); err != nil {
			t.Fatalf("write the legacy tables: %v", err)
		}
	}
	return tb
}

func hasScopeColumn(ctx context.Context, t *testing.T, db pgsink.DB, table string) bool {
	t.Helper()
	var n int
	err := db.QueryRow(ctx, "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'scope' AND NOT attisdropped", table).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// Without Config.LegacyScope, tables from before fence scopes are refused
// with an error that says what to set, and left as they are; a sink that
// skipped CreateSchema is told the same by its first write.
func TestLegacyTablesRefused(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	ctx := ctxFor(t, time.Minute)
	tb := legacyTables(ctx, t, db, "", "old_")
	cfg := pgsink.Config{DB: db, Prefix: "old_", Logger: quiet()}
	err := pgsink.CreateSchema(ctx, db, cfg)
	if !errors.Is(err, pgsink.ErrLegacySchema) {
		t.Fatalf("CreateSchema over legacy tables = %v, want an error matching ErrLegacySchema", err)
	}
	for _, want := range []string{"Config.LegacyScope", tb.Fence, tb.Effects, tb.Keys, "Config.Prefix"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("the refusal %q does not name %s", err, want)
		}
	}
	for _, table := range []string{tb.Fence, tb.Effects, tb.Keys} {
		if hasScopeColumn(ctx, t, db, table) {
			t.Fatalf("a refused CreateSchema changed %s", table)
		}
	}
	s, err := pgsink.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l := lease("orders", 0, 41)
	err = s.Apply(ctx, sink.Effect{Stamp: l.Stamp("orders.0.3.0"), Subject: "s"})
	if !errors.Is(err, pgsink.ErrLegacySchema) || !strings.Contains(err.Error(), "CreateSchema") || !strings.Contains(err.Error(), "LegacyScope") {
		t.Fatalf("Apply into legacy tables = %v, want ErrLegacySchema naming CreateSchema and LegacyScope", err)
	}
	if err := s.Advance(ctx, l); !errors.Is(err, pgsink.ErrLegacySchema) {
		t.Fatalf("Advance on legacy tables = %v, want ErrLegacySchema", err)
	}
}

// With Config.LegacyScope, the tables are upgraded in place: the fences,
// effects and keys belong to that scope, keep fencing and deduplicating,
// and other scopes start fresh beside them.
func TestLegacyTablesUpgrade(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	ctx := ctxFor(t, time.Minute)
	legacyTables(ctx, t, db, "", "old_")
	cfg := pgsink.Config{Prefix: "old_", LegacyScope: "orders"}
	s := newSink(t, db, cfg)
	orders0 := leasehold.FenceID{Scope: "orders", Partition: 0}
	if f, err := s.Fence(ctx, orders0); err != nil || f != (leasehold.FenceState{Epoch: 40, Holder: "w40"}) {
		t.Fatalf("upgraded fence %s = %+v, %v; want epoch 40 held by w40, no acquisition", orders0, f, err)
	}
	if f, _ := s.Fence(ctx, leasehold.FenceID{Scope: "orders", Partition: 1}); f.Epoch != 7 {
		t.Fatalf("upgraded fence orders/1 = %+v, want epoch 7", f)
	}
	es, err := applied(ctx, db, s)
	if err != nil || len(es) != 2 || es[0].Stamp.Scope != "orders" || es[1].Stamp.Scope != "orders" {
		t.Fatalf("upgraded effects %+v, %v; want two of scope orders", es, err)
	}
	// Running it again, as every start does, changes nothing.
	if err := pgsink.CreateSchema(ctx, db, pgsink.Config{DB: db, Prefix: "old_", Logger: quiet()}); err != nil {
		t.Fatalf("CreateSchema over upgraded tables: %v", err)
	}

	// The holder of epoch 40 carries on: its first write records its
	// acquisition, and an applied key stays applied.
	holder := lease("orders", 0, 40)
	again := sink.Effect{Stamp: holder.Stamp("orders.0.1.0"), Subject: "s", Data: []byte("new data")}
	for range 2 {
		if err := s.Apply(ctx, again); err != nil {
			t.Fatalf("a legacy key re-applied by the holder: %v", err)
		}
	}
	if f, _ := s.Fence(ctx, orders0); f.Acquisition != holder.Acquisition {
		t.Fatalf("fence %+v: the holder's acquisition was not recorded", f)
	}
	calls := 0
	if err := s.ApplyTx(ctx, holder.Stamp("orders.0.2.0"), func(context.Context, pgx.Tx) error { calls++; return nil }); err != nil || calls != 0 {
		t.Fatalf("a legacy ApplyTx key: %v, handler called %d times; want a duplicate", err, calls)
	}
	twin := holder
	twin.Acquisition = "twin"
	if err := s.Apply(ctx, sink.Effect{Stamp: twin.Stamp("orders.0.4.0"), Subject: "s"}); !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("epoch 40 from another acquisition = %v, want ErrSplitBrain", err)
	}
	if err := s.Apply(ctx, sink.Effect{Stamp: lease("orders", 0, 39).Stamp("orders.0.5.0"), Subject: "s"}); !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("epoch 39 = %v, want ErrStaleEpoch", err)
	}
	// Another job stream starts on the same partition with lower epochs,
	// and the same key: nothing of orders' refuses or deduplicates it.
	other := sink.Effect{Stamp: lease("payments", 0, 3).Stamp("orders.0.1.0"), Subject: "s", Data: []byte("payments")}
	if err := s.Apply(ctx, other); err != nil {
		t.Fatalf("another scope on the upgraded tables: %v", err)
	}
	es, err = applied(ctx, db, s)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range es {
		got[e.Stamp.Scope+" "+e.Stamp.Key] = string(e.Data)
	}
	want := map[string]string{"orders orders.0.1.0": "old data", "orders orders.1.1.0": "old data", "payments orders.0.1.0": "payments"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("effects %v, want %v", got, want)
	}
}

// Several sink processes starting at once on legacy tables: one upgrades
// them, the others find them upgraded, and nothing is lost or doubled.
func TestLegacyUpgradeConcurrent(t *testing.T) {
	t.Parallel()
	srv := pgtest.Start(t)
	ctx := ctxFor(t, 2*time.Minute)
	dsn := srv.CreateDatabase(t, "legacy")
	tb := legacyTables(ctx, t, pool(t, dsn), "shop", "leasehold_")
	const processes = 4
	start := make(chan struct{})
	errs := make(chan error, processes)
	var wg sync.WaitGroup
	for range processes {
		db := pool(t, dsn)
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs <- pgsink.CreateSchema(ctx, db, pgsink.Config{DB: db, Schema: "shop", LegacyScope: "orders", Logger: quiet()})
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("CreateSchema in one of %d processes starting at once: %v", processes, err)
		}
	}
	db := pool(t, dsn)
	for table, want := range map[string]int{tb.Fence: 2, tb.Effects: 2, tb.Keys: 1} {
		var n, scoped int
		if err := db.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE scope = 'orders') FROM "+table).Scan(&n, &scoped); err != nil {
			t.Fatal(err)
		}
		if n != want || scoped != want {
			t.Fatalf("%s: %d rows, %d of scope orders; want %d", table, n, scoped, want)
		}
	}
	s := newSink(t, db, pgsink.Config{Schema: "shop"})
	if f, err := s.Fence(ctx, leasehold.FenceID{Scope: "orders", Partition: 0}); err != nil || f.Epoch != 40 {
		t.Fatalf("fence after the upgrade: %+v, %v", f, err)
	}
}
