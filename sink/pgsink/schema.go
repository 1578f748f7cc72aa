package pgsink

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Tables names the tables a sink uses. Their DDL is in CreateSchema.
type Tables struct {
	// Fence holds each partition's recorded maximum and its holder.
	Fence string
	// Effects holds the effects Apply writes, keyed by idempotency key.
	Effects string
	// Keys holds the idempotency keys of ApplyTx calls, for dedupe.
	Keys string
}

func tablesFor(schema, prefix string) Tables {
	name := func(t string) string {
		if schema != "" {
			return pgx.Identifier{schema, prefix + t}.Sanitize()
		}
		return pgx.Identifier{prefix + t}.Sanitize()
	}
	return Tables{Fence: name("fence"), Effects: name("effects"), Keys: name("keys")}
}

// CreateSchema creates the sink's tables if they do not exist. It is safe
// to run at every start and from several processes.
func CreateSchema(ctx context.Context, db DB, cfg Config) error {
	cfg.setDefaults()
	if err := cfg.validateNames(); err != nil {
		return err
	}
	t := tablesFor(cfg.Schema, cfg.Prefix)
	ddl := ""
	if cfg.Schema != "" {
		ddl += "CREATE SCHEMA IF NOT EXISTS " + pgx.Identifier{cfg.Schema}.Sanitize() + ";\n"
	}
	ddl += fmt.Sprintf(`
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
);`, t.Fence, t.Effects, t.Keys)
	// Concurrent CREATE ... IF NOT EXISTS can still collide in the
	// catalog; a transaction-level advisory lock serialises them.
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("pgsink: create schema: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext($1))", "leasehold-pgsink-schema"); err != nil {
		return fmt.Errorf("pgsink: create schema: %w", err)
	}
	if _, err := tx.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("pgsink: create schema: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgsink: create schema: %w", err)
	}
	return nil
}
