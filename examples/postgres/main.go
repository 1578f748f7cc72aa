// Command postgres runs a job handler that writes to PostgreSQL through
// leasehold's fenced sink: each "orders" job marks an order paid and
// credits the merchant's account in one transaction (pgsink.ApplyTx) that
// also checks the job's epoch against the partition's fence and records
// the job's idempotency key. Midway, worker-a freezes in the middle of a
// job; worker-b takes the partition over, and worker-a's late transaction
// is refused as a whole.
//
//	go run ./examples/postgres -nats nats://127.0.0.1:4222 -postgres postgres://localhost/shop
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"regexp"
	"syscall"
)

// config is what the example needs to know.
type config struct {
	// NATS is the server URL. Default $NATS_URL, else
	// nats://127.0.0.1:4222.
	NATS string
	// Postgres is the database's connection string. Default
	// $DATABASE_URL. Required.
	Postgres string
	// Partitions of the job stream. Default 4.
	Partitions int
	// Jobs is the number of orders to pay. Default 20.
	Jobs int
	// Prefix names the job stream ("<prefix>-jobs") and the lease bucket
	// ("<prefix>-leases"). Default "orders".
	Prefix string
	// Schema holds the example's tables. It is dropped and created again
	// on every run, so the example refuses a schema it did not create.
	// Default "leasehold_example".
	Schema string
	// Logger receives the components' own logs. Default: none.
	Logger *slog.Logger
}

const (
	defaultNATS   = "nats://127.0.0.1:4222"
	defaultPrefix = "orders"
	defaultSchema = "leasehold_example"
)

func (c *config) setDefaults() {
	if c.NATS == "" {
		c.NATS = defaultNATS
	}
	if c.Partitions == 0 {
		c.Partitions = 4
	}
	if c.Jobs == 0 {
		c.Jobs = 20
	}
	if c.Prefix == "" {
		c.Prefix = defaultPrefix
	}
	if c.Schema == "" {
		c.Schema = defaultSchema
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

var (
	token      = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)
	identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)
)

func (c config) validate() error {
	var errs []error
	if c.Postgres == "" {
		errs = append(errs, errors.New("no PostgreSQL: pass -postgres postgres://user:password@host:5432/db or set DATABASE_URL"))
	}
	if c.Partitions < 1 || c.Partitions > 256 {
		errs = append(errs, fmt.Errorf("-partitions %d: use 1 to 256", c.Partitions))
	}
	if c.Jobs < 1 || c.Jobs > 100_000 {
		errs = append(errs, fmt.Errorf("-jobs %d: use 1 to 100000", c.Jobs))
	}
	if !token.MatchString(c.Prefix) {
		errs = append(errs, fmt.Errorf("-prefix %q: use letters, digits, '-' and '_' only (it is a subject token)", c.Prefix))
	}
	if !identifier.MatchString(c.Schema) {
		errs = append(errs, fmt.Errorf("-schema %q: use lower-case letters, digits and '_', starting with a letter", c.Schema))
	}
	return errors.Join(errs...)
}

func main() {
	var cfg config
	var verbose bool
	flag.StringVar(&cfg.NATS, "nats", os.Getenv("NATS_URL"), "NATS server `URL` (default $NATS_URL, else "+defaultNATS+")")
	flag.StringVar(&cfg.Postgres, "postgres", os.Getenv("DATABASE_URL"), "PostgreSQL connection `string` (default $DATABASE_URL)")
	flag.IntVar(&cfg.Partitions, "partitions", 4, "partitions of the job stream")
	flag.IntVar(&cfg.Jobs, "jobs", 20, "orders to pay")
	flag.StringVar(&cfg.Prefix, "prefix", defaultPrefix, "`name` of the job stream and lease bucket")
	flag.StringVar(&cfg.Schema, "schema", defaultSchema, "PostgreSQL `schema` for the tables (dropped and re-created on every run)")
	flag.BoolVar(&verbose, "v", false, "also log what the components do, to stderr")
	flag.Parse()
	if verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "postgres:", err)
		os.Exit(1)
	}
}
