package pgsink

import (
	"errors"
	"io"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leasehold/leasehold/sink"
)

// A database that is restarting, unreachable or silent is not the
// effect's fault: the error says so with sink.ErrUnavailable, so that a
// stream sink runner retries without dead-lettering the effect. An error
// of the statement itself does not.
func TestUnavailableErrorsAreMarked(t *testing.T) {
	for _, c := range []struct {
		name        string
		err         error
		unavailable bool
	}{
		{"starting up", &pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}, true},
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true},
		{"connection failure", &pgconn.PgError{Code: "08006"}, true},
		{"too many connections", &pgconn.PgError{Code: "53300"}, true},
		{"no answer", io.ErrUnexpectedEOF, true},
		{"a unique violation", &pgconn.PgError{Code: "23505"}, false},
		{"a syntax error", &pgconn.PgError{Code: "42601"}, false},
	} {
		if got := errors.Is(describe(c.err), sink.ErrUnavailable); got != c.unavailable {
			t.Errorf("%s: marked unavailable %v, want %v (%v)", c.name, got, c.unavailable, describe(c.err))
		}
	}
}
