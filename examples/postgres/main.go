// Command postgres: a job handler whose SQL commits in one transaction with
// the fence check and the job's idempotency key (pgsink.ApplyTx). worker-a
// freezes in the middle of a job; worker-b takes over and pays the order;
// worker-a wakes up, and its late transaction is refused whole. One call,
// statuspage.Serve, serves the status page, /metrics, /livez and /readyz;
// with -http they stay up at the end, the refusal on the page.
//
//	go run ./examples/postgres -postgres postgres://user:password@127.0.0.1:5432/shop [-nats URL] [-http :8080]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/worker"
)

type Order struct{ ID string }

// The schema is dropped and made again on every run; its comment marks it ours.
const mark = "leasehold examples/postgres: dropped and re-created on every run"

const ddl = `DO $$ BEGIN IF EXISTS (SELECT FROM pg_namespace WHERE nspname = 'leasehold_example' AND obj_description(oid, 'pg_namespace') IS DISTINCT FROM '` + mark + `')
THEN RAISE 'schema leasehold_example exists and was not created by this example: use another database'; END IF; END $$;
DROP SCHEMA IF EXISTS leasehold_example CASCADE;
CREATE SCHEMA leasehold_example;
COMMENT ON SCHEMA leasehold_example IS '` + mark + `';
CREATE TABLE leasehold_example.orders (id text PRIMARY KEY, cents bigint NOT NULL, payments int NOT NULL DEFAULT 0, paid_by text);
CREATE TABLE leasehold_example.accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL);
INSERT INTO leasehold_example.orders (id, cents) VALUES ('o-1', 1000), ('o-2', 2000), ('o-3', 3000);
INSERT INTO leasehold_example.accounts VALUES ('merchant', 0);`

func main() {
	var o options
	flag.StringVar(&o.nats, "nats", os.Getenv("NATS_URL"), "NATS server `URL` (empty: an embedded server)")
	flag.StringVar(&o.postgres, "postgres", os.Getenv("DATABASE_URL"), "PostgreSQL connection `string`")
	flag.StringVar(&o.http, "http", "", "`address` to serve the status page, /metrics, /livez and /readyz on, and keep serving at the end until interrupted")
	flag.Parse()
	stop, cancelStop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancelStop()
	o.hold = func(ctx context.Context, url string) error {
		fmt.Printf("the status page at %s shows the refusal; Ctrl-C to stop\n", url)
		<-stop.Done()
		return nil
	}
	ctx, cancel := context.WithTimeout(stop, time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout, o); err != nil {
		log.Fatal(err)
	}
}

// options: where NATS and PostgreSQL are, the page's address, what to do at the end.
type options struct {
	nats, postgres, http string
	hold                 func(ctx context.Context, url string) error
}

// run plays the example and returns the error that refused worker-a's late transaction.
func run(ctx context.Context, out io.Writer, o options) (*leasehold.StaleEpochError, error) {
	say := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	db, err := pgxpool.New(ctx, o.postgres)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if _, err := db.Exec(ctx, ddl); err != nil {
		return nil, fmt.Errorf("PostgreSQL (pass -postgres or set DATABASE_URL): %w", err)
	}
	if err := pgsink.CreateSchema(ctx, db, pgsink.Config{DB: db, Schema: "leasehold_example"}); err != nil {
		return nil, err // the sink's tables: leasehold_fence and leasehold_keys
	}
	opts := []nats.Option{}
	if o.nats == "" {
		dir, err := os.MkdirTemp("", "pgexample")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		srv, err := server.NewServer(&server.Options{JetStream: true, StoreDir: dir, DontListen: true, NoSigs: true})
		if err != nil {
			return nil, err
		}
		srv.Start()
		defer srv.Shutdown()
		opts = append(opts, nats.InProcessServer(srv))
	}
	nc, err := nats.Connect(o.nats, opts...)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "orders", Partitions: 1, NoEffects: true}); err != nil {
		return nil, err
	}
	if s, err := js.Stream(ctx, worker.JobsStream("orders")); err != nil || s.Purge(ctx) != nil { // an earlier run's
		return nil, fmt.Errorf("drop an earlier run's jobs: %v", err)
	}
	leases, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases"})
	if err != nil {
		return nil, err
	}
	// One call: events to the stream ProvisionJobs made, the page and probes served.
	page, err := statuspage.Serve(ctx, statuspage.ServeConfig{JetStream: js, Bucket: leases, Prefix: "orders", Name: "shop", Addr: o.http})
	if err != nil {
		return nil, err
	}
	defer page.Close()
	// Both UPDATEs commit in ApplyTx with the fence check and the key, or not at all.
	held, wake, late := make(chan leasehold.Stamp, 1), make(chan struct{}), make(chan error, 1)
	handler := func(sink *pgsink.Sink) worker.Handler {
		return worker.JSON(func(ctx context.Context, job *worker.Job, o Order) error {
			stamp, err := job.NextStamp() // partition, epoch, idempotency key
			if err != nil {
				return err
			}
			frozen := stamp.Worker == "worker-a" && o.ID == "o-2"
			if frozen {
				held <- stamp
				<-wake
				ctx = context.WithoutCancel(ctx) // a frozen process never looks at its context
			}
			err = sink.ApplyTx(ctx, stamp, func(ctx context.Context, tx pgx.Tx) error {
				var cents int64
				if err := tx.QueryRow(ctx, `UPDATE leasehold_example.orders SET payments = payments + 1, paid_by = $2
					WHERE id = $1 RETURNING cents`, o.ID, stamp.Worker).Scan(&cents); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `UPDATE leasehold_example.accounts SET balance_cents = balance_cents + $1 WHERE id = 'merchant'`, cents)
				return err
			})
			if frozen {
				late <- err
			}
			return err
		})
	}
	start := func(name string) (context.CancelFunc, chan error, error) {
		sink, err := pgsink.New(pgsink.Config{DB: db, Schema: "leasehold_example", Observer: page.SinkObserver(), Telemetry: page.Telemetry()})
		if err != nil {
			return nil, nil, err
		}
		w, err := worker.New(worker.Config{JetStream: js, Prefix: "orders", Partitions: 1, Bucket: leases, Handler: handler(sink),
			Fences:          []worker.Fence{sink}, // raised in PostgreSQL on acquiring a partition, before its first job
			BarrierSubjects: func(leasehold.Partition) []string { return nil },
			Coordinator:     coordinator.Config{Worker: name, ShutdownTimeout: time.Second, RebalanceDelay: 100 * time.Millisecond},
			Observer:        page.WorkerObserver(nil), Telemetry: page.Telemetry()})
		wctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		if err == nil {
			page.Ready(w.Ready)
			go func() { done <- w.Run(wctx) }()
		}
		return stop, done, err
	}
	table := func() error { // each order's payments, and the merchant's balance
		var t string
		err := db.QueryRow(ctx, `SELECT string_agg(format('   %s: payments %s, paid by %s', id, payments, coalesce(paid_by, '-')), E'\n' ORDER BY id)
			|| format(E'\n   merchant balance: %s cents', (SELECT balance_cents FROM leasehold_example.accounts)) FROM leasehold_example.orders`).Scan(&t)
		say("%s", t)
		return err
	}
	say("1. worker-a takes the partition; jobs pay o-1, o-2 and o-3")
	stopA, doneA, err := start("worker-a")
	if err != nil {
		return nil, err
	}
	defer stopA()
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "orders", Partitions: 1, Bucket: leases})
	if err != nil {
		return nil, err
	}
	var jobs []worker.Enqueued
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		j, err := worker.Enqueue(ctx, p, "pay", Order{id})
		if err != nil {
			return nil, err
		}
		jobs = append(jobs, j)
	}
	var stale leasehold.Stamp
	select {
	case stale = <-held:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	say("2. worker-a pays o-1, then freezes in o-2 holding its stamp (epoch %d, key %s)", stale.Epoch, stale.Key)
	say("3. worker-a is told to stop; its drain gives up on the frozen handler; worker-b takes over")
	stopA()
	stopB, doneB, err := start("worker-b")
	if err != nil {
		return nil, err
	}
	defer stopB()
	if _, err := p.Wait(ctx, jobs...); err != nil {
		return nil, err
	}
	say("   worker-b resumed after worker-a's last commit (a job it ran again found its key applied: skipped)")
	if err := table(); err != nil {
		return nil, err
	}
	say("4. worker-a wakes up and runs its transaction for o-2 under epoch %d", stale.Epoch)
	close(wake)
	var refused *leasehold.StaleEpochError
	select {
	case err = <-late:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if !errors.As(err, &refused) {
		return nil, fmt.Errorf("worker-a's late transaction: got %v, want a *leasehold.StaleEpochError", err)
	}
	say("   refused whole, before its UPDATEs ran: %v", err)
	if err := table(); err != nil {
		return nil, err
	}
	if err := <-doneA; err != nil {
		return nil, fmt.Errorf("worker-a: %w", err)
	}
	if o.http != "" && o.hold != nil {
		if err := o.hold(ctx, page.URL()); err != nil {
			return nil, err
		}
	}
	stopB()
	return refused, <-doneB
}
