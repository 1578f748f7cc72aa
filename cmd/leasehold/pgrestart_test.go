package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/pgtest"
	"github.com/leasehold/leasehold/worker"
)

// PostgreSQL goes away under a running `leasehold sink --kind postgres`
// while workers keep producing, and comes back: the sink retries with
// backoff, and every job's effect ends up in the database exactly once.
func TestPostgresSinkSurvivesARestart(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts PostgreSQL")
	}
	pg := pgtest.Start(t)
	s, ctx := initialized(t, 3*time.Minute, "--partitions", "2")
	background(t, "worker", "--nats", s.URL(), "--partitions", "2", "--worker-id", "pw", "--ttl", "2s", "--http", "", "--log-level", "warn")
	background(t, "sink", "--nats", s.URL(), "--kind", "postgres", "--postgres-url", pg.DSN(), "--verify-epochs", "--http", "", "--log-level", "warn")

	db, err := pgxpool.New(ctx, pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	p, err := worker.NewProducer(s.JetStream(t), worker.ProducerConfig{Prefix: "leasehold", Partitions: 2})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	enqueue := func(n int) {
		for i := range n {
			e, err := p.Enqueue(ctx, []byte(fmt.Sprintf("k-%d-%d", len(keys), i)), []byte("job"))
			if err != nil {
				t.Fatal(err)
			}
			keys = append(keys, leasehold.EffectKey("leasehold", e.Partition, e.Seq, 0))
		}
	}
	rows := func() (n, distinct int, err error) {
		qctx, qcancel := context.WithTimeout(ctx, 2*time.Second)
		defer qcancel()
		err = db.QueryRow(qctx, "SELECT count(*), count(DISTINCT key) FROM leasehold_effects").Scan(&n, &distinct)
		return
	}
	missing := func(keys []string) []string {
		var out []string
		for _, k := range keys {
			var one int
			if err := db.QueryRow(context.Background(), "SELECT 1 FROM leasehold_effects WHERE key = $1", k).Scan(&one); err != nil {
				out = append(out, k)
			}
		}
		return out
	}
	waitRows := func(want int) {
		for {
			n, d, err := rows()
			if err == nil && n >= want {
				if n != d {
					t.Fatalf("%d rows for %d keys: an effect was applied twice", n, d)
				}
				return
			}
			select {
			case <-ctx.Done():
				t.Fatalf("%d of %d effects applied (%v); missing: %v", n, want, err, missing(keys[:want]))
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	enqueue(100)
	waitRows(20)
	pg.Stop()
	enqueue(100) // handled by the worker; the sink meets a database that is away
	time.Sleep(2 * time.Second)
	pg.Start(t)
	waitRows(len(keys))
	for _, k := range keys {
		var one int
		if err := db.QueryRow(ctx, "SELECT 1 FROM leasehold_effects WHERE key = $1", k).Scan(&one); err != nil {
			t.Fatalf("effect %s: %v", k, err)
		}
	}
	if n, d, _ := rows(); n != len(keys) || d != len(keys) {
		t.Fatalf("%d rows, %d keys, want %d", n, d, len(keys))
	}
}
