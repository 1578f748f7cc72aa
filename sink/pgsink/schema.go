package pgsink

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
)

// Tables names the tables a sink uses. Their DDL is in CreateSchema.
type Tables struct {
	// Fence holds each fence's recorded maximum, the acquisition that set
	// it and its holder, keyed by (scope, partition).
	Fence string
	// Effects holds the effects Apply writes, keyed by (scope,
	// idempotency key).
	Effects string
	// Keys holds the idempotency keys of ApplyTx calls, for dedupe, keyed
	// by (scope, idempotency key).
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

// pkeyName is the name of a table's primary key constraint: PostgreSQL's
// own default, spelt out so that an upgraded table gets the same one as a
// new table (the sink tells a duplicate key by it).
func pkeyName(prefix, table string) string { return prefix + table + "_pkey" }

// The DDL of each table, with the table name and its primary key's name.
const (
	fenceDDL = `CREATE TABLE IF NOT EXISTS %s (
	scope       text        NOT NULL CHECK (scope <> ''),
	partition   integer     NOT NULL CHECK (partition >= 0),
	epoch       bigint      NOT NULL CHECK (epoch > 0),
	acquisition text        NOT NULL DEFAULT '',
	holder      text        NOT NULL DEFAULT '',
	updated_at  timestamptz NOT NULL DEFAULT now(),
	CONSTRAINT %s PRIMARY KEY (scope, partition)
)`
	effectsDDL = `CREATE TABLE IF NOT EXISTS %s (
	scope      text        NOT NULL,
	key        text        NOT NULL,
	partition  integer     NOT NULL,
	epoch      bigint      NOT NULL,
	subject    text        NOT NULL,
	data       bytea,
	header     jsonb,
	applied_at timestamptz NOT NULL DEFAULT now(),
	CONSTRAINT %s PRIMARY KEY (scope, key)
)`
	keysDDL = `CREATE TABLE IF NOT EXISTS %s (
	scope      text        NOT NULL,
	key        text        NOT NULL,
	partition  integer     NOT NULL,
	epoch      bigint      NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now(),
	CONSTRAINT %s PRIMARY KEY (scope, key)
)`
)

// schemaLock names the advisory lock that serialises CreateSchema across
// processes: concurrent CREATE ... IF NOT EXISTS can still collide in the
// catalog, and two processes must not both upgrade legacy tables.
const schemaLock = "leasehold-pgsink-schema"

// CreateSchema creates the sink's tables if they do not exist, and
// upgrades tables created before fence scopes (see Config.LegacyScope). It
// is one transaction under an advisory lock, so it is safe to run at every
// start and from several processes at once: the first upgrades, the others
// then find the tables current.
//
// Tables created before fence scopes are keyed by partition and
// idempotency key alone. Without Config.LegacyScope, CreateSchema changes
// nothing and returns an error matching ErrLegacySchema that says what to
// set.
func CreateSchema(ctx context.Context, db DB, cfg Config) error {
	cfg.setDefaults()
	if err := cfg.validateNames(); err != nil {
		return fmt.Errorf("pgsink: create schema: %w", err)
	}
	tx, err := db.BeginTx(ctx, pgx.TxOptions{})
	if err != nil {
		return fmt.Errorf("pgsink: create schema: %w", describe(err))
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext($1))", schemaLock); err != nil {
		return fmt.Errorf("pgsink: create schema: %w", describe(err))
	}
	if cfg.Schema != "" {
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()); err != nil {
			return fmt.Errorf("pgsink: create schema: %w", describe(err))
		}
	}
	t := tablesFor(cfg.Schema, cfg.Prefix)
	tables := []struct {
		table, name, ddl string
	}{
		{t.Fence, "fence", fenceDDL},
		{t.Effects, "effects", effectsDDL},
		{t.Keys, "keys", keysDDL},
	}
	var legacy []legacyTable
	for _, tb := range tables {
		state, err := inspect(ctx, tx, tb.table, tb.name)
		if err != nil {
			return fmt.Errorf("pgsink: create schema: %w", err)
		}
		switch state {
		case tableMissing:
			ddl := fmt.Sprintf(tb.ddl, tb.table, pgx.Identifier{pkeyName(cfg.Prefix, tb.name)}.Sanitize())
			if _, err := tx.Exec(ctx, ddl); err != nil {
				return fmt.Errorf("pgsink: create table %s: %w", tb.table, describe(err))
			}
		case tableLegacy:
			legacy = append(legacy, legacyTable{table: tb.table, name: tb.name})
		}
	}
	if len(legacy) > 0 {
		if cfg.LegacyScope == "" {
			return legacyError(legacy)
		}
		if err := upgrade(ctx, tx, cfg, legacy); err != nil {
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgsink: create schema: %w", describe(err))
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	for _, l := range legacy {
		log.Info("pgsink: upgraded a table created before fence scopes: its rows belong to the legacy scope now",
			slog.String("table", l.table), slog.String("scope", cfg.LegacyScope))
	}
	return nil
}
