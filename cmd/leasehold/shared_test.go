package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/pgtest"
	"github.com/leasehold/leasehold/worker"
)

// Two job streams, run as the command line runs them, applying into one
// sink: one KV bucket, or one PostgreSQL database with the default tables.
// The stream whose lease bucket is created later has the higher epochs;
// when fences were kept per partition alone, its first effect fenced out
// every effect of the other stream on that partition (0 of 10 applied).
// With fences per scope every committed job of both streams is applied.
func TestTwoJobStreamsShareOneSink(t *testing.T) {
	t.Parallel()
	t.Run("kv", func(t *testing.T) {
		testSharedSink(t, []string{"--kind", "kv", "--kv-bucket", "shared"}, func(ctx context.Context, t *testing.T, js jetstream.JetStream) func(string) bool {
			var kv jetstream.KeyValue
			return func(key string) bool {
				if kv == nil {
					kv, _ = js.KeyValue(ctx, "shared")
					if kv == nil {
						return false
					}
				}
				_, err := kv.Get(ctx, key)
				return err == nil
			}
		})
	})
	t.Run("postgres", func(t *testing.T) {
		if testing.Short() {
			t.Skip("starts PostgreSQL")
		}
		pg := pgtest.Start(t)
		testSharedSink(t, []string{"--kind", "postgres", "--postgres-url", pg.DSN()}, func(ctx context.Context, t *testing.T, _ jetstream.JetStream) func(string) bool {
			db, err := pgxpool.New(ctx, pg.DSN())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(db.Close)
			return func(key string) bool {
				qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				var n int
				err := db.QueryRow(qctx, "SELECT count(*) FROM leasehold_effects WHERE key = $1", key).Scan(&n)
				if err == nil && n > 1 {
					t.Fatalf("effect %s applied %d times", key, n)
				}
				return err == nil && n == 1
			}
		})
	})
}

func testSharedSink(t *testing.T, sinkArgs []string, applied func(context.Context, *testing.T, jetstream.JetStream) func(string) bool) {
	s, ctx := listening(t, 2*time.Minute)
	js := s.JetStream(t)
	prefixes := []string{"orders", "payments"}
	var keys []string
	for _, prefix := range prefixes {
		if out, err := run(t, ctx, "init", "--nats", s.URL(), "--prefix", prefix, "--partitions", "2"); err != nil {
			t.Fatalf("init %s: %v\n%s", prefix, err, out)
		}
		background(t, "worker", "--nats", s.URL(), "--prefix", prefix, "--partitions", "2", "--worker-id", prefix+"-w", "--ttl", "2s", "--http", "", "--log-level", "error")
		args := append([]string{"sink", "--nats", s.URL(), "--prefix", prefix, "--name", prefix + "-sink", "--http", "", "--log-level", "error"}, sinkArgs...)
		background(t, args...)
		p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: 2})
		if err != nil {
			t.Fatal(err)
		}
		for i := range 15 {
			e, err := p.Enqueue(ctx, []byte(fmt.Sprintf("k-%d", i)), []byte("job"))
			if err != nil {
				t.Fatal(err)
			}
			keys = append(keys, leasehold.EffectKey(prefix, e.Partition, e.Seq, 0))
		}
	}
	has := applied(ctx, t, js)
	done := 0
	for _, k := range keys {
		for !has(k) {
			select {
			case <-ctx.Done():
				t.Fatalf("%d of %d effects of two job streams sharing one sink applied; %s never was", done, len(keys), k)
			case <-time.After(50 * time.Millisecond):
			}
		}
		done++
	}
	t.Logf("%d of %d effects of two job streams applied into one sink", done, len(keys))
}
