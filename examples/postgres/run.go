package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// frozenDrain is how long worker-a's shutdown waits for its frozen
// handler before it gives the partition up.
const frozenDrain = time.Second

// run plays the example, narrating on out.
func run(ctx context.Context, out io.Writer, cfg config) (err error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return err
	}
	s := &script{w: out}
	db, err := pgxpool.New(ctx, cfg.Postgres)
	if err != nil {
		return fmt.Errorf("PostgreSQL connection string: %w", err)
	}
	defer db.Close()
	if err := db.Ping(ctx); err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w (is it up? pass -postgres or set DATABASE_URL)", err)
	}
	nc, err := connectNATS(cfg.NATS, "orders-example")
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}

	orders, leftover, err := setUp(ctx, js, db, cfg)
	if err != nil {
		return err
	}
	zombieOrder := pickZombieOrder(orders)
	s.printf("leasehold example: a job handler that writes to PostgreSQL through the fenced sink\n")
	s.say("NATS        %s: job stream %s (%d partitions), lease bucket %s-leases", cfg.NATS, worker.JobsStream(cfg.Prefix), cfg.Partitions, cfg.Prefix)
	s.say("PostgreSQL  schema %s: the shop's orders and accounts, the sink's leasehold_fence and leasehold_keys", cfg.Schema)
	if leftover > 0 {
		s.say("            (purged the %s of an earlier run from the job stream)", count(int(leftover), "job"))
	}
	s.say("Each job pays one order, in one transaction through pgsink.ApplyTx: the check of the")
	s.say("job's stamp against the partition's fence, the job's idempotency key, then")
	s.say("  UPDATE orders SET status = 'paid', payments = payments + 1, paid_by, paid_epoch ...")
	s.say("  UPDATE accounts SET balance_cents = balance_cents + the order's cents ...")
	s.say("all committed together or not at all.")

	z := newZombie("worker-a", zombieOrder.ID)
	tr := newTracker()
	var a, b *member
	defer func() {
		z.abort()
		for _, m := range []*member{a, b} {
			if m != nil {
				if serr := m.stop(); serr != nil && err == nil {
					err = fmt.Errorf("%s: %w", m.name, serr)
				}
			}
		}
	}()

	// 1. worker-a alone takes every partition.
	s.step("worker-a starts and takes every partition")
	if a, err = startMember(ctx, cfg, db, "worker-a", frozenDrain, tr, z); err != nil {
		return err
	}
	if err := tr.wait(ctx, "worker-a to take every partition", func() bool { return len(tr.ready["worker-a"]) == cfg.Partitions }); err != nil {
		return err
	}
	tr.mu.Lock()
	epochsA := epochList(tr.epochs["worker-a"])
	tr.mu.Unlock()
	s.say("worker-a holds partitions %s; epochs by partition:", partitionList(cfg.Partitions))
	s.say("  %s", epochsA)
	s.say("Before its first job on each partition, it advanced the partition's fence in")
	s.say("PostgreSQL to its epoch (worker.Config.Fences).")

	// 2. The orders go in.
	s.step(fmt.Sprintf("%s enqueued: order o-N goes to partition (N-1) mod %d", count(len(orders), "order"), cfg.Partitions))
	if err := enqueue(ctx, js, cfg, orders); err != nil {
		return err
	}

	// 3. worker-a pays what it can, and freezes in the middle of one order.
	var stamp leasehold.Stamp
	select {
	case stamp = <-z.frozen:
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Minute):
		return errors.New("worker-a did not reach the order it freezes in within a minute; run with -v to see what it does")
	}
	before := ordersBefore(orders, zombieOrder)
	if err := tr.wait(ctx, "worker-a to pay the orders before the frozen one", func() bool { return hasAll(tr.finished["worker-a"], before) }); err != nil {
		return err
	}
	s.step(fmt.Sprintf("worker-a pays %s, then freezes in the middle of order %s (partition %d)", count(len(before), "order"), zombieOrder.ID, zombieOrder.Partition))
	s.say("It holds the job's stamp: partition %d, epoch %d, key %s,", stamp.Partition, stamp.Epoch, stamp.Key)
	s.say("and has not written yet. (A stop-the-world GC pause, a hung call, a SIGSTOP: the")
	s.say("process cannot tell.)")

	// 4. worker-a is stopped; worker-b starts.
	s.step("worker-a is told to stop, as in a rolling deploy, and worker-b starts")
	a.cancel()
	if b, err = startMember(ctx, cfg, db, "worker-b", 0, tr, nil); err != nil {
		return err
	}
	if err := tr.wait(ctx, "worker-a to release partition 0", func() bool { return tr.released["worker-a"][zombieOrder.Partition] }); err != nil {
		return err
	}
	s.say("worker-a drains its partitions. Partition %d's drain waits %v for the frozen handler,", zombieOrder.Partition, frozenDrain)
	s.say("gives up, and releases the lease so that the partition does not wait for its TTL.")

	// 5. worker-b takes the partition and raises the fence.
	if err := tr.wait(ctx, "worker-b to take partition 0", func() bool { return tr.ready["worker-b"][zombieOrder.Partition] }); err != nil {
		return err
	}
	e2 := epochOf(tr, "worker-b", zombieOrder.Partition)
	s.step(fmt.Sprintf("worker-b takes partition %d at a higher epoch and raises the fence", zombieOrder.Partition))
	s.say("worker-b holds partition %d at epoch %d > worker-a's %d.", zombieOrder.Partition, e2, stamp.Epoch)
	max, holder, err := fenceRow(ctx, db, cfg.Schema, cfg.Prefix, zombieOrder.Partition)
	if err != nil {
		return err
	}
	s.say("leasehold_fence, partition %d: epoch %d%s. From now on a transaction stamped", zombieOrder.Partition, max, holderNote(holder))
	s.say("with an older epoch is refused.")

	// 6. worker-b pays the rest.
	if err := tr.wait(ctx, "every order to be paid", func() bool {
		return len(paidBy(tr, "worker-a", "worker-b")) == len(orders)
	}); err != nil {
		return err
	}
	var fresh []string
	tr.mu.Lock()
	for _, o := range orders {
		if tr.finished["worker-b"][o.ID] && !tr.finished["worker-a"][o.ID] {
			fresh = append(fresh, o.ID)
		}
	}
	dups := tr.dups["worker-b"]
	tr.mu.Unlock()
	s.step("worker-b pays the rest")
	s.say("worker-b paid %s, from the last progress worker-a committed.", strings.Join(fresh, ", "))
	if dups > 0 {
		s.say("It ran %s again that worker-a had paid but not committed yet: their keys were", count(dups, "job"))
		s.say("in leasehold_keys, so ApplyTx skipped them, and nothing was paid twice.")
	} else {
		s.say("worker-a had committed every order it paid, so no job ran twice this time; one that")
		s.say("did would find its key in leasehold_keys, and ApplyTx would skip it.")
	}

	// 7. worker-a wakes up and writes.
	balance, err := merchantBalance(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	s.step(fmt.Sprintf("worker-a wakes up and runs its transaction for order %s under epoch %d", zombieOrder.ID, stamp.Epoch))
	z.wakeUp()
	var zerr error
	select {
	case zerr = <-z.done:
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Minute):
		return errors.New("worker-a's late transaction did not end within a minute")
	}
	var stale *leasehold.StaleEpochError
	if !errors.As(zerr, &stale) {
		return fmt.Errorf("worker-a's late transaction: got %v, want a *leasehold.StaleEpochError", zerr)
	}
	s.say("refused: %v", zerr)
	s.say("errors.Is(err, leasehold.ErrStaleEpoch) = %t", errors.Is(zerr, leasehold.ErrStaleEpoch))
	after, err := merchantBalance(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	row, err := orderRow(ctx, db, cfg.Schema, zombieOrder.ID)
	if err != nil {
		return err
	}
	s.say("The fence check is the transaction's first statement: a stale stamp ends it before")
	s.say("the handler's UPDATEs run, and nothing of it commits.")
	s.say("order %s: %s", zombieOrder.ID, row)
	s.say("merchant balance: %s before, %s after", dollars(balance), dollars(after))

	// 8. Both workers stop; the tables say what happened.
	if err := a.stop(); err != nil {
		return fmt.Errorf("worker-a: %w", err)
	}
	if err := b.stop(); err != nil {
		return fmt.Errorf("worker-b: %w", err)
	}
	s.step("final state of PostgreSQL")
	if err := report(ctx, s, db, cfg, len(orders)); err != nil {
		return err
	}
	s.say("stale transactions refused: %d (partition %d)", a.sink.Dropped(leasehold.FenceID{Scope: cfg.Prefix, Partition: zombieOrder.Partition}), zombieOrder.Partition)
	return s.err
}
