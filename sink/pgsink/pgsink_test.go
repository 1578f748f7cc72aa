package pgsink_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	srv, db := startDB(t)
	sinktest.Run(t, sinktest.Features{Durable: true, AtomicBatch: true, Dedupe: true, VerifiedEpochs: true, Parallel: true},
		func(t *testing.T, st sinktest.Setup) sinktest.Instance {
			cfg := pgsink.Config{Prefix: st.Name + "_", Observer: st.Observer, Verifier: st.Verifier}
			s := newSink(t, db, cfg)
			inst := sinktest.Instance{Sink: s}
			inst.Applied = func(ctx context.Context) ([]sink.Effect, error) { return applied(ctx, db, s) }
			inst.Reopen = func(ctx context.Context) (sink.Sink, error) {
				// A new pool and a new sink: nothing survives but the tables.
				db2 := pool(t, srv.DSN())
				cfg.DB, cfg.Logger = db2, quiet()
				s2, err := pgsink.New(cfg)
				if err != nil {
					return nil, err
				}
				s = s2
				return s2, nil
			}
			return inst
		})
}

// ApplyTx runs the handler's SQL in the fenced transaction: a stale stamp
// never calls it, a duplicate key calls it once, and its error rolls the
// fence and key back too.
func TestApplyTx(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	ctx := ctxFor(t, time.Minute)
	s := newSink(t, db, pgsink.Config{Prefix: "tx_"})
	if _, err := db.Exec(ctx, "CREATE TABLE orders (id text PRIMARY KEY, total int)"); err != nil {
		t.Fatal(err)
	}
	calls := 0
	insert := func(id string, total int) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			calls++
			_, err := tx.Exec(ctx, "INSERT INTO orders VALUES ($1, $2)", id, total)
			return err
		}
	}
	st := stampOf(lease("shop", 1, 5), "order-1")
	if err := s.ApplyTx(ctx, st, insert("o1", 10)); err != nil {
		t.Fatal(err)
	}
	if err := s.ApplyTx(ctx, st, insert("o1", 10)); err != nil {
		t.Fatalf("duplicate: %v", err)
	}
	if calls != 1 {
		t.Fatalf("handler called %d times for one key, want once", calls)
	}
	if err := s.Advance(ctx, lease("shop", 1, 9)); err != nil {
		t.Fatal(err)
	}
	stale := stampOf(lease("shop", 1, 8), "order-2")
	if err := s.ApplyTx(ctx, stale, insert("o2", 20)); !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("stale ApplyTx = %v, want ErrStaleEpoch", err)
	}
	if calls != 1 {
		t.Fatal("the handler ran under a stale stamp")
	}
	// The same epoch from another acquisition is a split brain: refused,
	// and the handler does not run.
	twin := stampOf(lease("shop", 1, 9), "order-2")
	twin.Acquisition = "twin"
	if err := s.ApplyTx(ctx, twin, insert("o2", 20)); !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("split-brain ApplyTx = %v, want ErrSplitBrain", err)
	}
	if calls != 1 {
		t.Fatal("the handler ran under a split-brain stamp")
	}
	// The same key in another scope is another write.
	if err := s.ApplyTx(ctx, stampOf(lease("billing", 1, 2), "order-1"), insert("b1", 10)); err != nil {
		t.Fatalf("the same key in another scope: %v", err)
	}
	if calls != 2 {
		t.Fatalf("handler called %d times, want twice: the key of one scope deduplicated another's", calls)
	}
	boom := errors.New("handler failed")
	st3 := stampOf(lease("shop", 2, 3), "order-3")
	if err := s.ApplyTx(ctx, st3, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders VALUES ('o3', 30)"); err != nil {
			return err
		}
		return boom
	}); !errors.Is(err, boom) {
		t.Fatalf("ApplyTx = %v, want the handler's error", err)
	}
	if f, _ := s.Fence(ctx, leasehold.FenceID{Scope: "shop", Partition: 2}); f.Epoch != 0 {
		t.Fatalf("a failed handler left the fence at %d", f.Epoch)
	}
	// The key was rolled back with the handler's writes, so a retry runs.
	if err := s.ApplyTx(ctx, st3, insert("o3", 30)); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.QueryRow(ctx, "SELECT count(*) FROM orders").Scan(&n); err != nil || n != 3 {
		t.Fatalf("orders: %d, %v; want 3", n, err)
	}
}

// A sink whose tables are missing says what to run.
func TestMissingSchema(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	s, err := pgsink.New(pgsink.Config{DB: db, Prefix: "absent_", Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	err = s.Apply(ctxFor(t, time.Minute), sink.Effect{Stamp: stampOf(lease("jobs", 1, 1), "k"), Subject: "s"})
	if err == nil || !strings.Contains(err.Error(), "pgsink.CreateSchema") {
		t.Fatalf("Apply without tables = %v, want an error that names pgsink.CreateSchema", err)
	}
	if _, err := pgsink.New(pgsink.Config{DB: db, Prefix: "Bad-Prefix"}); err == nil {
		t.Fatal("New accepted a prefix that is not a plain identifier")
	}
	if _, err := pgsink.New(pgsink.Config{}); err == nil || !strings.Contains(err.Error(), "DB is required") {
		t.Fatalf("New without DB = %v", err)
	}
}

// PostgreSQL stops under a running sink and comes back: while it is down
// the sink returns clear errors, and afterwards every effect is applied
// exactly once.
func TestPostgresRestart(t *testing.T) {
	t.Parallel()
	srv, db := startDB(t)
	ctx := ctxFor(t, 3*time.Minute)
	s := newSink(t, db, pgsink.Config{Prefix: "restart_"})
	const total = 300
	progress := make(chan int, total)
	downErr := make(chan error, 1)
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(progress)
		for i := range total {
			e := sink.Effect{Stamp: stampOf(lease("jobs", 3, 7), fmt.Sprintf("restart-%d", i)), Subject: "s", Data: []byte{byte(i)}}
			// Retry each effect until it is applied, as a worker does.
			for {
				err := s.Apply(ctx, e)
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					return
				}
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
				select {
				case downErr <- err:
				default:
				}
				time.Sleep(20 * time.Millisecond)
			}
			progress <- i
		}
	}()
	for i := range progress {
		if i == 50 {
			srv.Stop()
			<-downErr
			// Let the writer meet the refused connections too.
			for range 2 {
				<-downErr
			}
			srv.Start(t)
		}
	}
	wg.Wait()
	mu.Lock()
	for _, err := range errs {
		if !strings.Contains(err.Error(), "PostgreSQL") || !strings.Contains(err.Error(), "retry") {
			t.Errorf("error while PostgreSQL is down: %q does not say what happened and what to do", err)
		}
	}
	mu.Unlock()
	var n, distinct int
	if err := db.QueryRow(ctx, "SELECT count(*), count(DISTINCT key) FROM "+s.Tables().Effects).Scan(&n, &distinct); err != nil {
		t.Fatal(err)
	}
	if n != total || distinct != total {
		t.Fatalf("%d rows, %d distinct keys, want %d of each", n, distinct, total)
	}
}

// A raise waits for a transaction writing under the current epoch: the
// take-over's Advance blocks on the fence row until the former holder's
// ApplyTx commits, so the former holder's writes land before the raise and
// never after it.
func TestRaiseWaitsForWriter(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
	ctx := ctxFor(t, time.Minute)
	// The raise waits for as long as the test needs.
	s := newSink(t, db, pgsink.Config{Prefix: "wait_", LockTimeout: -1})
	if err := s.Advance(ctx, lease("jobs", 5, 10)); err != nil {
		t.Fatal(err)
	}
	inside, release := make(chan struct{}), make(chan struct{})
	txDone := make(chan error, 1)
	go func() {
		txDone <- s.ApplyTx(ctx, stampOf(lease("jobs", 5, 10), "slow"), func(ctx context.Context, tx pgx.Tx) error {
			close(inside)
			<-release
			return nil
		})
	}()
	<-inside
	advDone := make(chan error, 1)
	go func() { advDone <- s.Advance(ctx, lease("jobs", 5, 11)) }()
	waitLockWaiters(ctx, t, db, 1, advDone)
	close(release)
	if err := <-txDone; err != nil {
		t.Fatal(err)
	}
	if err := <-advDone; err != nil {
		t.Fatal(err)
	}
	if f, _ := s.Fence(ctx, leasehold.FenceID{Scope: "jobs", Partition: 5}); f.Epoch != 11 || f.Acquisition != acq(11) {
		t.Fatalf("fence %+v, want epoch 11 of %s", f, acq(11))
	}
}
