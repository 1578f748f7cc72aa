package main

import (
	"context"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// report prints the final state of the tables.
func report(ctx context.Context, s *script, db *pgxpool.Pool, cfg config, n int) error {
	orders := pgx.Identifier{cfg.Schema, "orders"}.Sanitize()
	var paid, once int
	var sum int64
	err := db.QueryRow(ctx, "SELECT count(*) FILTER (WHERE status = 'paid'), count(*) FILTER (WHERE payments = 1), coalesce(sum(cents), 0) FROM "+orders).
		Scan(&paid, &once, &sum)
	if err != nil {
		return fmt.Errorf("read the orders: %w", err)
	}
	s.say("orders: %d of %d paid; %d paid exactly once (payments = 1)", paid, n, once)
	rows, err := db.Query(ctx, "SELECT paid_by, paid_epoch, partition, count(*) FROM "+orders+" WHERE paid_by IS NOT NULL GROUP BY 1, 2, 3 ORDER BY 1, 3")
	if err != nil {
		return fmt.Errorf("read the orders: %w", err)
	}
	for rows.Next() {
		var by string
		var epoch int64
		var p int32
		var n int
		if err := rows.Scan(&by, &epoch, &p, &n); err != nil {
			return err
		}
		s.say("  %s, partition %d, epoch %d: %s", by, p, epoch, count(n, "order"))
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the orders: %w", err)
	}
	balance, err := merchantBalance(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	verdict := "equal to"
	if balance != sum {
		verdict = "NOT equal to"
	}
	s.say("accounts: merchant balance %s, %s the sum of the orders, %s", dollars(balance), verdict, dollars(sum))
	rows, err = db.Query(ctx, "SELECT partition, epoch, holder FROM "+pgx.Identifier{cfg.Schema, "leasehold_fence"}.Sanitize()+" ORDER BY partition")
	if err != nil {
		return fmt.Errorf("read the fences: %w", err)
	}
	for rows.Next() {
		var p int32
		var e int64
		var h string
		if err := rows.Scan(&p, &e, &h); err != nil {
			return err
		}
		s.say("leasehold_fence: partition %d at epoch %d%s", p, e, holderNote(h))
	}
	return rows.Err()
}

// script prints the narration: numbered steps, indented lines. It keeps
// the first write error.
type script struct {
	w   io.Writer
	n   int
	err error
}

func (s *script) printf(format string, args ...any) {
	if s.err == nil {
		_, s.err = fmt.Fprintf(s.w, format, args...)
	}
}

func (s *script) step(title string) {
	s.n++
	s.printf("\n%d. %s\n", s.n, title)
}

func (s *script) say(format string, args ...any) { s.printf("   "+format+"\n", args...) }

// count says "1 order", "2 orders".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
