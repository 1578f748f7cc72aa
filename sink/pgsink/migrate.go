package pgsink

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ErrLegacySchema is matched by the error CreateSchema returns when it
// finds tables created before fence scopes and Config.LegacyScope is not
// set, and by the error of a write into such tables.
var ErrLegacySchema = errors.New("pgsink: the tables were created before fence scopes")

// Tables created before fence scopes are keyed by partition (the fence) and
// by idempotency key (effects and keys), and have no scope column. All
// their rows were written by one job stream, whose scope is
// Config.LegacyScope; the upgrade gives every row that scope, adds the
// fence's acquisition column (empty: the first acquisition that writes at
// the recorded epoch is then recorded, see leasehold.Judge), and re-keys
// each table by scope. Keys written before keep deduplicating, since the
// idempotency keys a worker derives did not change.

type tableState int

const (
	tableMissing tableState = iota
	tableCurrent
	tableLegacy
)

// legacyTable is a table to upgrade: its quoted name, and its name
// without the prefix ("fence", "effects", "keys").
type legacyTable struct{ table, name string }

// legacyColumns are the columns a table of each kind had before scopes; a
// table without them is not the sink's, and is left alone.
var legacyColumns = map[string][]string{
	"fence":   {"partition", "epoch", "holder"},
	"effects": {"key", "partition", "epoch", "subject"},
	"keys":    {"key", "partition", "epoch"},
}

// currentColumns are the columns that tell a table of each kind is current.
var currentColumns = map[string][]string{
	"fence":   {"scope", "partition", "epoch", "acquisition", "holder"},
	"effects": {"scope", "key", "partition", "epoch", "subject"},
	"keys":    {"scope", "key", "partition", "epoch"},
}

// inspect tells whether table (quoted, resolved like the sink's statements)
// is missing, current or legacy. A table that is neither is an error.
func inspect(ctx context.Context, tx pgx.Tx, table, name string) (tableState, error) {
	var exists bool
	var cols []string
	err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
		coalesce((SELECT array_agg(attname::text) FROM pg_attribute
			WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped), '{}')`, table).Scan(&exists, &cols)
	if err != nil {
		return 0, describe(err)
	}
	has := func(want []string) bool {
		for _, c := range want {
			if !slices.Contains(cols, c) {
				return false
			}
		}
		return true
	}
	switch {
	case !exists:
		return tableMissing, nil
	case has(currentColumns[name]):
		return tableCurrent, nil
	case !slices.Contains(cols, "scope") && has(legacyColumns[name]):
		return tableLegacy, nil
	}
	return 0, fmt.Errorf("table %s exists but is not a leasehold sink table (its columns are %s): set Config.Prefix or Config.Schema to use other tables",
		table, strings.Join(cols, ", "))
}

func legacyError(legacy []legacyTable) error {
	names := make([]string, len(legacy))
	for i, l := range legacy {
		names[i] = l.table
	}
	verb := "are"
	if len(names) == 1 {
		verb = "is"
	}
	return fmt.Errorf("%w: %s %s keyed by partition alone, with no scope: set Config.LegacyScope to the scope that wrote them "+
		"(normally the job stream's prefix, the Leasehold-Scope its workers stamp) and run CreateSchema again, which upgrades them in place; "+
		"or set Config.Prefix to start on new tables",
		ErrLegacySchema, strings.Join(names, ", "), verb)
}

// upgrade re-keys the legacy tables by scope, in tx (which holds the
// schema lock): every row gets cfg.LegacyScope. Adding a column with a
// constant default rewrites nothing; the new primary key is built once.
func upgrade(ctx context.Context, tx pgx.Tx, cfg Config, legacy []legacyTable) error {
	var scope string
	// The server quotes the literal: a DEFAULT cannot be a parameter.
	if err := tx.QueryRow(ctx, "SELECT quote_literal($1::text)", cfg.LegacyScope).Scan(&scope); err != nil {
		return fmt.Errorf("pgsink: upgrade: %w", describe(err))
	}
	for _, l := range legacy {
		var oldKey string
		err := tx.QueryRow(ctx, "SELECT conname::text FROM pg_constraint WHERE conrelid = to_regclass($1) AND contype = 'p'", l.table).Scan(&oldKey)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("pgsink: upgrade %s: %w", l.table, describe(err))
		}
		keyCol := "key"
		add := fmt.Sprintf("ALTER TABLE %s ADD COLUMN scope text NOT NULL DEFAULT %s", l.table, scope)
		if l.name == "fence" {
			keyCol = "partition"
			add += " CHECK (scope <> ''), ADD COLUMN acquisition text NOT NULL DEFAULT ''"
		}
		stmts := []string{add, fmt.Sprintf("ALTER TABLE %s ALTER COLUMN scope DROP DEFAULT", l.table)}
		if oldKey != "" {
			stmts = append(stmts, fmt.Sprintf("ALTER TABLE %s DROP CONSTRAINT %s", l.table, pgx.Identifier{oldKey}.Sanitize()))
		}
		stmts = append(stmts, fmt.Sprintf("ALTER TABLE %s ADD CONSTRAINT %s PRIMARY KEY (scope, %s)",
			l.table, pgx.Identifier{pkeyName(cfg.Prefix, l.name)}.Sanitize(), keyCol))
		for _, s := range stmts {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("pgsink: upgrade %s to scope %q: %w", l.table, cfg.LegacyScope, describe(err))
			}
		}
	}
	return nil
}
