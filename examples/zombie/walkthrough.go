package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

const (
	part    = leasehold.Partition(0)
	account = "accounts.alice" // the KV key both workers write
)

// run plays the walk-through, narrating on out.
func run(ctx context.Context, out io.Writer, cfg config) error {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return err
	}
	s := &script{w: out}
	srv, err := openNATS(cfg.NATS)
	if err != nil {
		return err
	}
	defer srv.close()
	if err := setUp(ctx, srv, cfg); err != nil {
		return err
	}
	a, err := newWorker(ctx, srv, cfg, "worker-a")
	if err != nil {
		return err
	}
	defer a.nc.Close()
	b, err := newWorker(ctx, srv, cfg, "worker-b")
	if err != nil {
		return err
	}
	defer b.nc.Close()

	s.printf("leasehold zombie walk-through\n")
	s.printf("=============================\n")
	s.say("NATS:          %s", srv.desc)
	s.say("lease bucket:  %s-leases (lease TTL %v)", cfg.Name, cfg.TTL)
	s.say("fenced sink:   JetStream KV bucket %s-effects (sink/kvsink)", cfg.Name)
	s.say("partition %d's input: job 1 deposits 100, job 2 withdraws 30, job 3 deposits 50;", part)
	s.say("each job's effect writes alice's new balance to the key %s.", account)

	if err := play(ctx, s, a, b, cfg); err != nil {
		return err
	}
	return s.err
}

// setUp deletes what an earlier run left and provisions the lease bucket.
// The sinks create their bucket themselves.
func setUp(ctx context.Context, srv *natsServer, cfg config) error {
	nc, err := srv.connect("zombie-setup")
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	// The fence records outlive the lease bucket on purpose (its epochs and
	// progress survive a re-creation); a clean start removes them too.
	for _, name := range []string{cfg.Name + "-leases", coordinator.FenceBucketName(cfg.Name + "-leases"), cfg.Name + "-effects"} {
		if err := js.DeleteKeyValue(ctx, name); err != nil && !errors.Is(err, jetstream.ErrBucketNotFound) {
			return fmt.Errorf("delete bucket %s left by an earlier run: %w", name, err)
		}
	}
	// A new bucket's revisions start at the current time in microseconds,
	// so epochs stay above those of the bucket just deleted (with its
	// fence records kept, above every epoch they recorded).
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: cfg.Name + "-leases"}); err != nil {
		return fmt.Errorf("provision the lease bucket: %w (a server without JetStream? start nats-server with -js)", err)
	}
	return nil
}

func play(ctx context.Context, s *script, a, b *worker, cfg config) error {
	// 1. A takes the partition. ManualRenew stands in for the renewals a
	// paused process would not send: this lease renews only when asked.
	s.step("worker-a acquires partition 0")
	leaseA, err := a.coord.Acquire(ctx, part, coordinator.ManualRenew())
	if err != nil {
		return fmt.Errorf("worker-a: acquire: %w", err)
	}
	e1 := leaseA.Epoch()
	s.say("worker-a holds partition %d at epoch e1 = %d.", part, e1)
	s.say("The epoch is the revision of the KV write that took the lease: every later")
	s.say("acquisition of partition %d gets a higher one. It is the partition's fencing token.", part)
	s.say("(A new lease bucket's revisions start at the time in microseconds, so epochs keep")
	s.say("growing even when the bucket is deleted and created again.)")
	if err := a.sink.Advance(ctx, leaseA.Info()); err != nil {
		return fmt.Errorf("worker-a: advance the sink: %w", err)
	}
	s.say("worker-a tells the sink its epoch before the first write (Advance), as a worker")
	s.say("does when it acquires a partition: sink max epoch for partition %d = %d.", part, maxEpoch(ctx, a))

	// 2. A works.
	s.step("worker-a handles job 1 and writes through the fenced sink")
	if err := a.write(ctx, s, leaseA.Info(), 1, 100); err != nil {
		return fmt.Errorf("worker-a: job 1: %w", err)
	}
	if err := leaseA.Commit(ctx, 1); err != nil {
		return fmt.Errorf("worker-a: commit job 1: %w", err)
	}
	s.say("worker-a: Commit(1) -> committed: partition %d's input progress is job 1.", part)

	// 3. A pauses: from here until step 7 none of A's code runs.
	s.step("worker-a starts job 2, computes balance 70, and pauses before writing it")
	s.say("worker-a stops renewing its lease. In a real process this is a stop-the-world GC")
	s.say("pause, a SIGSTOP, a VM migration or a swap storm: no code of the process runs, so")
	s.say("it can neither renew nor notice that it should stop. (Here the lease was acquired")
	s.say("with coordinator.ManualRenew and nobody calls Renew.)")
	s.say("The server keeps worker-a's lease for %v after its last write, then deletes it.", cfg.TTL)

	// 4. B wants the partition and waits for the server to expire A's lease.
	s.step("worker-b wants partition 0")
	start := time.Now()
	leaseB, err := acquireWhenFree(ctx, s, b)
	if err != nil {
		return err
	}
	s.say("The server expired worker-a's lease; worker-b acquired partition %d %v later.", part, time.Since(start).Round(100*time.Millisecond))

	// 5. B holds the partition with a higher epoch; progress and the sink
	// are fenced before B does anything else.
	e2 := leaseB.Epoch()
	s.step("worker-b holds partition 0 at a higher epoch")
	s.say("worker-b holds partition %d at epoch e2 = %d > e1 = %d.", part, e2, e1)
	fenced, err := b.coord.Bucket().FencedEpoch(ctx, part)
	if err != nil {
		return fmt.Errorf("read the fenced epoch: %w", err)
	}
	s.say("The acquisition fenced the partition's input progress under the new epoch:")
	s.say("lease bucket: fenced epoch %d, progress job %d (worker-a's last commit).", fenced, leaseB.Progress())
	if err := b.sink.Advance(ctx, leaseB.Info()); err != nil {
		return fmt.Errorf("worker-b: advance the sink: %w", err)
	}
	s.say("worker-b tells the sink (Advance): sink max epoch for partition %d = %d.", part, maxEpoch(ctx, b))
	s.say("From now on the sink refuses every write stamped with an epoch below %d.", e2)

	// 6. B picks up after the last commit: job 2 again, then job 3.
	s.step("worker-b handles jobs 2 and 3")
	for _, j := range []struct {
		seq     uint64
		balance int
	}{{2, 70}, {3, 120}} {
		if err := b.write(ctx, s, leaseB.Info(), j.seq, j.balance); err != nil {
			return fmt.Errorf("worker-b: job %d: %w", j.seq, err)
		}
	}
	if err := leaseB.Commit(ctx, 3); err != nil {
		return fmt.Errorf("worker-b: commit job 3: %w", err)
	}
	s.say("worker-b: Commit(3) -> committed.")

	// 7. A wakes up in the middle of job 2, exactly where it stopped.
	s.step("worker-a wakes up and carries on where it stopped: writing job 2's balance")
	s.say("Had worker-a kept running, its lease context would have told it to stop:")
	s.say("  context.Cause(lease.Context()) = %v", context.Cause(leaseA.Context()))
	s.say("but a paused process cannot look before it writes: the write was already under way.")
	s.say("worker-a's own sink handle last saw e1, so it sends the write; the server checks the")
	s.say("fence atomically with the write and refuses the batch, and the sink reads the fence again.")
	werr := a.write(ctx, s, leaseA.Info(), 2, 70)
	var stale *leasehold.StaleEpochError
	if !errors.As(werr, &stale) {
		return fmt.Errorf("worker-a's stale write: got %v, want a *leasehold.StaleEpochError", werr)
	}
	s.say("          -> refused: %v", werr)
	s.say("errors.Is(err, leasehold.ErrStaleEpoch) = %t;", errors.Is(werr, leasehold.ErrStaleEpoch))
	s.say("*leasehold.StaleEpochError{Partition: %d, Epoch: %d, Max: %d, Worker: %q, Holder: %q}",
		stale.Partition, stale.Epoch, stale.Max, stale.Worker, stale.Holder)
	s.say("Had the sink taken it, alice's balance would have gone back from 120 to 70,")
	s.say("and job 3's deposit would be lost.")

	// 8. A tries to record progress.
	s.step("worker-a tries to commit job 2")
	cerr := leaseA.Commit(ctx, 2)
	if !errors.Is(cerr, leasehold.ErrLeaseLost) {
		return fmt.Errorf("worker-a's commit: got %v, want an error matching leasehold.ErrLeaseLost", cerr)
	}
	s.say("worker-a: Commit(2) -> refused: %v", cerr)
	s.say("errors.Is(err, leasehold.ErrLeaseLost) = %t. The commit is a compare-and-set on the", errors.Is(cerr, leasehold.ErrLeaseLost))
	s.say("progress record, which worker-b fenced: a zombie can never move progress past work")
	s.say("whose effects were refused, so no job is skipped.")

	// 9. What is left.
	s.step("final state")
	if err := finalState(ctx, s, a, b); err != nil {
		return err
	}
	if err := leaseB.Release(ctx); err != nil {
		return fmt.Errorf("worker-b: release: %w", err)
	}
	return nil
}
