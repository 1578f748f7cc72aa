package pgsink_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// writer is one job stream, or the lock, writing through its own sink
// process into the shared database.
type writer struct {
	scope string
	parts int             // partitions 0..parts-1
	base  leasehold.Epoch // partition p's first holder has epoch base+p
	s     *pgsink.Sink

	mu      sync.Mutex
	refused []sink.Decision
}

func (w *writer) Decided(_ context.Context, d sink.Decision) {
	if d.Outcome.Dropped() {
		w.mu.Lock()
		w.refused = append(w.refused, d)
		w.mu.Unlock()
	}
}

func (w *writer) lease(p leasehold.Partition, e leasehold.Epoch) leasehold.Lease {
	return leasehold.Lease{Scope: w.scope, Partition: p, Epoch: e, Acquisition: fmt.Sprintf("%s-%d", acq(e), p), Holder: fmt.Sprintf("%s-w%d", w.scope, e)}
}

// jobKey is the idempotency key of job j of partition p: the same spelling
// in every scope.
func jobKey(p leasehold.Partition, j int) string { return fmt.Sprintf("job-%d-%d", p, j) }

// Two job streams, orders and payments, with the same partition numbers
// and keys and epochs 10^6 apart, and a lock, write into one database
// through the default tables, each from its own sink process. Every
// effect is applied once; a zombie of each is refused by its own fence
// alone; nothing is refused, or deduplicated, because of another scope.
func TestTwoJobStreamsAndALock(t *testing.T) {
	t.Parallel()
	srv := pgtest.Start(t)
	dsn := srv.CreateDatabase(t, "shared")
	ctx := ctxFor(t, 2*time.Minute)
	writers := []*writer{
		{scope: "orders", parts: 4, base: 1_000},
		{scope: "payments", parts: 4, base: 1_001_000},
		{scope: leasehold.LockScope("leases", "report-generator"), parts: 1, base: 500},
	}
	if _, err := pool(t, dsn).Exec(ctx, "CREATE TABLE ledger (scope text, key text, PRIMARY KEY (scope, key))"); err != nil {
		t.Fatal(err)
	}
	// The sink processes start at once, each creating the schema.
	var wg sync.WaitGroup
	for _, w := range writers {
		db := pool(t, dsn)
		wg.Add(1)
		go func() {
			defer wg.Done()
			cfg := pgsink.Config{DB: db, Observer: w, Logger: quiet()}
			if err := pgsink.CreateSchema(ctx, db, cfg); err != nil {
				t.Errorf("%s: CreateSchema: %v", w.scope, err)
				return
			}
			w.s, _ = pgsink.New(cfg)
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	const jobs = 12
	ledger := func(scope, key string) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger VALUES ($1, $2)", scope, key)
			return err
		}
	}
	// run has partition p's holder l write jobs from..to-1: one effect,
	// a batch of two, or an ApplyTx, in turn.
	run := func(w *writer, l leasehold.Lease, from, to int) error {
		for j := from; j < to; j++ {
			key := jobKey(l.Partition, j)
			var err error
			switch j % 3 {
			case 0:
				err = w.s.Apply(ctx, sink.Effect{Stamp: l.Stamp(key), Subject: w.scope, Data: []byte(w.scope)})
			case 1:
				err = w.s.Apply(ctx,
					sink.Effect{Stamp: l.Stamp(key), Subject: w.scope, Data: []byte(w.scope)},
					sink.Effect{Stamp: l.Stamp(key + "-b"), Subject: w.scope, Data: []byte(w.scope)})
			default:
				err = w.s.ApplyTx(ctx, l.Stamp(key), ledger(w.scope, key))
			}
			if err != nil {
				return fmt.Errorf("%s %s under epoch %d: %w", w.scope, key, l.Epoch, err)
			}
		}
		return nil
	}
	// Every holder advances its fence and writes half of its jobs, all
	// at once.
	errs := make(chan error, 16)
	for _, w := range writers {
		for p := range leasehold.Partition(w.parts) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				l := w.lease(p, w.base+leasehold.Epoch(p))
				if err := w.s.Advance(ctx, l); err != nil {
					errs <- err
					return
				}
				if err := run(w, l, 0, jobs/2); err != nil {
					errs <- err
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Partition 0 of each scope changes hands; the successor re-runs the
	// last job of its predecessor (a duplicate) and carries on, and the
	// paused predecessor comes back.
	for _, w := range writers {
		old := w.lease(0, w.base)
		next := w.lease(0, w.base+100)
		if err := w.s.Advance(ctx, next); err != nil {
			t.Fatalf("%s: take-over: %v", w.scope, err)
		}
		if err := run(w, next, jobs/2-1, jobs); err != nil {
			t.Fatal(err)
		}
		zombie := []error{
			w.s.Apply(ctx, sink.Effect{Stamp: old.Stamp("zombie"), Subject: w.scope}),
			w.s.ApplyTx(ctx, old.Stamp("zombie-tx"), ledger(w.scope, "zombie-tx")),
		}
		for _, err := range zombie {
			var se *leasehold.StaleEpochError
			if !errors.As(err, &se) || se.Scope != w.scope || se.Max != next.Epoch || se.Holder != next.Holder {
				t.Fatalf("%s: the zombie's write = %v, want a stale-epoch error of its own scope with max %d held by %s", w.scope, err, next.Epoch, next.Holder)
			}
		}
	}
	// The other partitions' holders write the rest of their jobs.
	for _, w := range writers {
		for p := 1; p < w.parts; p++ {
			if err := run(w, w.lease(leasehold.Partition(p), w.base+leasehold.Epoch(p)), jobs/2, jobs); err != nil {
				t.Fatal(err)
			}
		}
	}

	db := pool(t, dsn)
	for _, w := range writers {
		want := map[string]bool{}
		for p := range leasehold.Partition(w.parts) {
			for j := range jobs {
				switch j % 3 {
				case 0:
					want["effect "+jobKey(p, j)] = true
				case 1:
					want["effect "+jobKey(p, j)] = true
					want["effect "+jobKey(p, j)+"-b"] = true
				default:
					want["ledger "+jobKey(p, j)] = true
					want["key "+jobKey(p, j)] = true
				}
			}
		}
		rows, err := db.Query(ctx, `SELECT 'effect ' || key FROM leasehold_effects WHERE scope = $1
			UNION ALL SELECT 'ledger ' || key FROM ledger WHERE scope = $1
			UNION ALL SELECT 'key ' || key FROM leasehold_keys WHERE scope = $1`, w.scope)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, g := range got {
			if seen[g] {
				t.Fatalf("%s: %s applied twice", w.scope, g)
			}
			if !want[g] {
				t.Fatalf("%s: %s was applied and should not have been", w.scope, g)
			}
			seen[g] = true
		}
		if len(seen) != len(want) {
			t.Fatalf("%s: %d of %d writes applied", w.scope, len(seen), len(want))
		}
		for p := range leasehold.Partition(w.parts) {
			id := leasehold.FenceID{Scope: w.scope, Partition: p}
			wantDrops := uint64(0)
			if p == 0 {
				wantDrops = 2
			}
			if n := w.s.Dropped(id); n != wantDrops {
				t.Fatalf("Dropped(%s) = %d, want %d", id, n, wantDrops)
			}
		}
		w.mu.Lock()
		for _, d := range w.refused {
			if d.Stamp.Scope != w.scope || d.Stamp.Epoch != w.base || (d.Stamp.Key != "zombie" && d.Stamp.Key != "zombie-tx") {
				t.Fatalf("%s refused %s of scope %s under epoch %d: only its own zombie may be refused", w.scope, d.Stamp.Key, d.Stamp.Scope, d.Stamp.Epoch)
			}
		}
		w.mu.Unlock()
	}
}
