package pgsink_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A fence row that recorded no acquisition at its epoch (migrated from the
// schema before acquisitions) is raised by the first acquisition seen at
// that epoch, which every other at that epoch is then refused for: that
// raise is verified like any other, in Apply, ApplyTx and Advance. The
// live holder's epoch with a forged acquisition is refused, and the
// holder's own raises the row and applies.
func TestEqualEpochRaiseIsVerified(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, time.Minute)
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "orders-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "orders-jobs", Subjects: []string{"orders.jobs.>"},
		Metadata: map[string]string{"leasehold.partitions": "4"}}); err != nil {
		t.Fatal(err)
	}
	c, err := coordinator.New(bucket, coordinator.Config{Worker: "holder", TTL: 5 * time.Second, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	_, db := startDB(t)
	s := newSink(t, db, pgsink.Config{Prefix: "eqraise_", Verifier: bucket})
	// rowWithout writes the fence row of l's partition at l's epoch with no
	// acquisition, as the schema before acquisitions left it.
	rowWithout := func(l leasehold.Lease) {
		t.Helper()
		if _, err := db.Exec(ctx, "INSERT INTO "+s.Tables().Fence+" (scope, partition, epoch, holder) VALUES ($1, $2, $3, 'old')",
			l.Scope, int32(l.Partition), int64(l.Epoch)); err != nil {
			t.Fatal(err)
		}
	}
	forgedOf := func(l leasehold.Lease, key string) leasehold.Stamp {
		return leasehold.Stamp{Scope: l.Scope, Partition: l.Partition, Epoch: l.Epoch, Acquisition: "forged", Key: key, Worker: "forger"}
	}
	for _, how := range []string{"Apply", "ApplyTx", "Advance"} {
		t.Run(how, func(t *testing.T) {
			p := map[string]leasehold.Partition{"Apply": 1, "ApplyTx": 2, "Advance": 3}[how]
			l, err := c.Acquire(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Release(context.WithoutCancel(ctx))
			info := l.Info()
			rowWithout(info)
			forged := forgedOf(info, how+"-forged")
			var ferr, herr error
			switch how {
			case "Apply":
				ferr = s.Apply(ctx, sink.Effect{Stamp: forged, Subject: "forged", Data: []byte("f")})
				herr = s.Apply(ctx, sink.Effect{Stamp: info.Stamp(how + "-holder"), Subject: "holder", Data: []byte("h")})
			case "ApplyTx":
				nop := func(context.Context, pgx.Tx) error { return nil }
				ferr = s.ApplyTx(ctx, forged, nop)
				herr = s.ApplyTx(ctx, info.Stamp(how+"-holder"), nop)
			case "Advance":
				bad := info
				bad.Acquisition = "forged"
				ferr = s.Advance(ctx, bad)
				herr = s.Advance(ctx, info)
			}
			if !errors.Is(ferr, sink.ErrUnverifiedEpoch) {
				t.Errorf("%s(the row's epoch with a forged acquisition, over a row with none) = %v, want an error matching sink.ErrUnverifiedEpoch", how, ferr)
			}
			if herr != nil {
				t.Errorf("the holder's %s after a forged one: %v", how, herr)
			}
			if f, err := s.Fence(ctx, info.Fence()); err != nil || f.Epoch != info.Epoch || f.Acquisition != info.Acquisition {
				t.Errorf("fence %+v, %v; want the holder's epoch %d and acquisition %s", f, err, info.Epoch, info.Acquisition)
			}
		})
	}
}
