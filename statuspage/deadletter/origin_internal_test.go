package deadletter

import (
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A job is first stored at or before the place where it is dead-lettered,
// so a dead letter whose origin lies in its own partition past that place
// is forged: replayed, it would take the keys of a job still to come. It
// is refused, as an origin that does not parse is; one at its own place
// (what the worker writes for a job that never moved), before it, or in
// another partition or stream is taken.
func TestJobOfRefusesAnOriginPastItsJob(t *testing.T) {
	d := Named(worker.DLQStream("shop"), "shop", false)
	subject := worker.JobSubject("shop", 2)
	letter := func(origin string) *jetstream.RawStreamMsg {
		h := nats.Header{}
		h.Set(worker.HeaderSubject, subject)
		h.Set(worker.HeaderSeq, "10")
		h.Set(worker.HeaderError, "the bank said no")
		if origin != "" {
			h.Set(leasehold.HeaderOrigin, origin)
		}
		return &jetstream.RawStreamMsg{Subject: worker.DLQSubject("shop", 2), Sequence: 4, Header: h, Data: []byte("x")}
	}
	for _, origin := range []string{"shop/2/11", "shop/2/12345"} {
		_, err := d.jobOf(letter(origin), subject)
		if err == nil || !errors.Is(err, leasehold.ErrBadOrigin) || !strings.Contains(err.Error(), "forged") {
			t.Errorf("a dead letter of job 10 with origin %s: %v; want it refused as forged", origin, err)
		}
	}
	for origin, want := range map[string]leasehold.Origin{
		"":           leasehold.OriginOf("shop", 2, 10),
		"shop/2/10":  leasehold.OriginOf("shop", 2, 10),
		"shop/2/3":   leasehold.OriginOf("shop", 2, 3),
		"shop/1/99":  leasehold.OriginOf("shop", 1, 99),
		"older/2/99": leasehold.OriginOf("older", 2, 99),
	} {
		job, err := d.jobOf(letter(origin), subject)
		if err != nil || job.origin != want || job.seq != 10 || job.partition != 2 {
			t.Errorf("a dead letter of job 10 with origin %q: %+v, %v; want origin %s", origin, job, err, want)
		}
	}
	// A purge records the forged one at its place, without its origin.
	job, err := d.jobOf(withoutOrigin(letter("shop/2/11")), subject)
	if err != nil || job.origin != leasehold.OriginOf("shop", 2, 10) {
		t.Errorf("without its origin: %+v, %v", job, err)
	}
}
