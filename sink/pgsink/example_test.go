package pgsink_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/pgsink"
)

// A handler's own SQL in the fenced transaction: the row is written only
// if epoch 42 (of acquisition a1b2c3) still holds partition 3 of the
// orders job stream, and only once for the key.
func ExampleSink_ApplyTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	cfg := pgsink.Config{DB: pool}
	if err := pgsink.CreateSchema(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	s, err := pgsink.New(cfg)
	if err != nil {
		log.Fatal(err)
	}
	st := leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 42, Acquisition: "a1b2c3", Key: "orders.3.17.0", Worker: "w1"}
	err = s.ApplyTx(ctx, st, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE orders SET status = 'paid' WHERE id = $1", 17)
		return err
	})
	if err != nil {
		log.Print(err)
	}
}
