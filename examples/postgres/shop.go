package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/worker"
)

// The application: orders to pay, and the merchant's account they are paid
// into. payments counts how often an order's payment was applied, so that
// "exactly once" can be read off the table.
const shopDDL = `
CREATE TABLE %[1]s.orders (
	id         text    PRIMARY KEY,
	partition  integer NOT NULL,
	cents      bigint  NOT NULL,
	status     text    NOT NULL DEFAULT 'new',
	payments   integer NOT NULL DEFAULT 0,
	paid_by    text,
	paid_epoch bigint
);
CREATE TABLE %[1]s.accounts (
	id            text   PRIMARY KEY,
	balance_cents bigint NOT NULL
);
INSERT INTO %[1]s.accounts VALUES ('merchant', 0);`

// schemaMark is the comment on a schema this example created: only such a
// schema is dropped on the next run.
const schemaMark = "leasehold examples/postgres: dropped and re-created on every run"

// resetSchema drops the schema a previous run created and creates it
// again with the shop's tables and the sink's.
func resetSchema(ctx context.Context, db *pgxpool.Pool, schema string) error {
	q := pgx.Identifier{schema}.Sanitize()
	var comment *string
	err := db.QueryRow(ctx, "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = $1", schema).Scan(&comment)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return fmt.Errorf("look for schema %s: %w", schema, err)
	case comment == nil || *comment != schemaMark:
		return fmt.Errorf("schema %s exists and was not created by this example, which drops its schema on every run: pass -schema with another name", schema)
	default:
		if _, err := db.Exec(ctx, "DROP SCHEMA "+q+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s left by an earlier run: %w", schema, err)
		}
	}
	ddl := "CREATE SCHEMA " + q + ";\nCOMMENT ON SCHEMA " + q + " IS '" + schemaMark + "';\n" + fmt.Sprintf(shopDDL, q)
	if _, err := db.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("create schema %s: %w", schema, err)
	}
	return pgsink.CreateSchema(ctx, db, pgsink.Config{DB: db, Schema: schema})
}

// seedOrders inserts the orders the jobs will pay and returns their IDs;
// order o-i goes to partition (i-1) mod partitions.
func seedOrders(ctx context.Context, db *pgxpool.Pool, schema string, n, partitions int) ([]order, error) {
	orders := make([]order, n)
	b := &pgx.Batch{}
	for i := range orders {
		o := order{ID: fmt.Sprintf("o-%d", i+1), Partition: leasehold.Partition(i % partitions), Cents: 500 + int64((i+1)*7919%9500)}
		orders[i] = o
		b.Queue("INSERT INTO "+pgx.Identifier{schema, "orders"}.Sanitize()+" (id, partition, cents) VALUES ($1, $2, $3)", o.ID, int32(o.Partition), o.Cents)
	}
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("insert the orders: %w", err)
	}
	return orders, nil
}

type order struct {
	ID        string
	Partition leasehold.Partition
	Cents     int64
}

// payJob is a job's payload.
type payJob struct {
	Order string `json:"order"`
}

// shop is the job handler's side of the example: the sink it writes
// through and the tables it writes.
type shop struct {
	sink   *pgsink.Sink
	orders string // quoted table names
	accts  string
	// freeze, when set, is asked before each write whether this write is
	// the one to freeze in (see zombie).
	freeze *zombie
}

// handle pays one order. Everything it writes goes into one transaction
// that pgsink fences with the job's stamp: the fence check, the
// idempotency key and the two UPDATEs commit together or not at all.
func (s *shop) handle(ctx context.Context, job *worker.Job, p payJob) error {
	stamp, err := job.NextStamp() // partition, epoch, idempotency key
	if err != nil {
		return err // the lease is gone: leasehold.ErrLeaseLost
	}
	if s.freeze.here(stamp, p.Order) {
		return s.freeze.freeze(ctx, stamp, func(ctx context.Context) error { return s.pay(ctx, stamp, p.Order) })
	}
	return s.pay(ctx, stamp, p.Order)
}

// pay is the fenced transaction. A stale stamp ends it before fn runs; a
// key applied before makes it a no-op; an error from fn rolls back all.
func (s *shop) pay(ctx context.Context, stamp leasehold.Stamp, id string) error {
	return s.sink.ApplyTx(ctx, stamp, func(ctx context.Context, tx pgx.Tx) error {
		var cents int64
		err := tx.QueryRow(ctx, `UPDATE `+s.orders+`
			SET status = 'paid', payments = payments + 1, paid_by = $2, paid_epoch = $3
			WHERE id = $1 RETURNING cents`, id, stamp.Worker, int64(stamp.Epoch)).Scan(&cents)
		if errors.Is(err, pgx.ErrNoRows) {
			return worker.Permanent(fmt.Errorf("order %s does not exist", id))
		}
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE `+s.accts+` SET balance_cents = balance_cents + $1 WHERE id = 'merchant'`, cents)
		return err
	})
}

func dollars(cents int64) string { return fmt.Sprintf("%d.%02d", cents/100, cents%100) }

func partitionList(n int) string {
	ps := make([]string, n)
	for i := range ps {
		ps[i] = fmt.Sprint(i)
	}
	return strings.Join(ps, ", ")
}
