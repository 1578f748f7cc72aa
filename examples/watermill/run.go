package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// run plays the example, narrating on out.
func run(ctx context.Context, out io.Writer, cfg config) error {
	_, err := play(ctx, out, cfg)
	return err
}

// received is what reached the downstream: every message its handler ran
// for, in order, and every message the middleware dropped.
type received struct {
	shipments []shipment
	dropped   []sink.Decision
}

func play(ctx context.Context, out io.Writer, cfg config) (res received, err error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return res, err
	}
	s := &script{w: out}
	srv, err := openNATS(cfg.NATS)
	if err != nil {
		return res, err
	}
	defer srv.close()
	nc, err := srv.connect("shipping-example")
	if err != nil {
		return res, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return res, err
	}
	leftover, err := setUp(ctx, js, cfg)
	if err != nil {
		return res, err
	}
	orders := make([]order, cfg.Jobs)
	for i := range orders {
		orders[i] = order{ID: fmt.Sprintf("o-%d", i+1), Partition: leasehold.Partition(i % cfg.Partitions)}
	}
	zombieOrder := pickZombieOrder(orders)
	z := newZombie("worker-a", zombieOrder.ID)
	tr := newTracker()

	d, err := startDownstream(ctx, cfg, tr)
	if err != nil {
		return res, err
	}
	pubsub, fencer := d.pubsub, d.fencer
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
		if cerr := d.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	select {
	case <-d.router.Running():
	case <-ctx.Done():
		return res, ctx.Err()
	}

	introduce(s, srv, cfg, leftover)

	// 1. worker-a alone takes every partition.
	s.step("worker-a starts and takes every partition")
	if a, err = startMember(ctx, srv, cfg, "worker-a", pubsub, z, frozenDrain, tr); err != nil {
		return res, err
	}
	if err := tr.wait(ctx, "worker-a to take every partition", func() bool { return len(tr.ready["worker-a"]) == cfg.Partitions }); err != nil {
		return res, err
	}
	tr.mu.Lock()
	epochsA := epochList(tr.epochs["worker-a"])
	tr.mu.Unlock()
	s.say("worker-a's epochs by partition: %s", epochsA)
	s.say("On acquiring each partition it published a barrier into %q (worker.Config.Fences),", topic)
	s.say("and the middleware raised the partition's maximum: partition %d's is now %d.", zombieOrder.Partition, fencer.State(leasehold.FenceID{Scope: cfg.Prefix, Partition: zombieOrder.Partition}).Epoch)

	// 2. The orders go in.
	s.step(fmt.Sprintf("%s enqueued: order o-N goes to partition (N-1) mod %d", count(len(orders), "order"), cfg.Partitions))
	if err := enqueue(ctx, js, cfg, orders); err != nil {
		return res, err
	}

	// 3. worker-a ships what it can; one message hangs.
	var stamp leasehold.Stamp
	select {
	case stamp = <-z.held:
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(time.Minute):
		return res, errors.New("worker-a did not publish the message that hangs within a minute; run with -v to see what it does")
	}
	before := ordersBefore(orders, zombieOrder)
	if err := tr.wait(ctx, "worker-a's other messages to be shipped", func() bool { return hasAll(tr.shippedBy()["worker-a"], before) }); err != nil {
		return res, err
	}
	s.step(fmt.Sprintf("worker-a ships %s; its message for %s hangs in the network", count(len(before), "order"), zombieOrder.ID))
	s.say("The message is stamped (partition %d, epoch %d, key %s)", stamp.Partition, stamp.Epoch, stamp.Key)
	s.say("and stuck on its way to the broker; worker-a's handler waits in Publish.")

	// 4. worker-a is stopped; worker-b starts.
	s.step("worker-a is told to stop, as in a rolling deploy, and worker-b starts")
	a.cancel()
	if b, err = startMember(ctx, srv, cfg, "worker-b", pubsub, nil, 0, tr); err != nil {
		return res, err
	}
	if err := tr.wait(ctx, "worker-a to release partition 0", func() bool { return tr.released["worker-a"][zombieOrder.Partition] }); err != nil {
		return res, err
	}
	s.say("worker-a drains its partitions. Partition %d's drain waits %v for the stuck handler,", zombieOrder.Partition, frozenDrain)
	s.say("gives up, and releases the lease so that the partition does not wait for its TTL.")

	// 5. worker-b takes the partition; its barrier raises the fence.
	if err := tr.wait(ctx, "worker-b to take partition 0", func() bool { return tr.ready["worker-b"][zombieOrder.Partition] }); err != nil {
		return res, err
	}
	tr.mu.Lock()
	e2 := tr.epochs["worker-b"][zombieOrder.Partition]
	tr.mu.Unlock()
	s.step(fmt.Sprintf("worker-b takes partition %d at a higher epoch; its barrier reaches the downstream", zombieOrder.Partition))
	s.say("worker-b holds partition %d at epoch %d > worker-a's %d.", zombieOrder.Partition, e2, stamp.Epoch)
	s.say("The middleware's maximum for partition %d is now %d: older messages are dropped.", zombieOrder.Partition, fencer.State(leasehold.FenceID{Scope: cfg.Prefix, Partition: zombieOrder.Partition}).Epoch)

	// 6. worker-b ships the rest.
	if err := tr.wait(ctx, "every order to be shipped", func() bool { return len(tr.byKeyOrders()) == len(orders) }); err != nil {
		return res, err
	}
	tr.mu.Lock()
	byB := tr.shippedBy()["worker-b"]
	repeats := 0
	for _, sh := range tr.shipments {
		if sh.Repeat {
			repeats++
		}
	}
	tr.mu.Unlock()
	s.step("worker-b ships the rest")
	s.say("worker-b shipped %s, from the last progress worker-a committed.", strings.Join(sortOrders(byB), ", "))
	if repeats > 0 {
		s.say("The messages of %s that worker-a had shipped but not committed came again from", count(repeats, "job"))
		s.say("worker-b, with the same idempotency keys; the downstream handler shipped each once.")
	}

	// 7. The stuck message arrives.
	s.step(fmt.Sprintf("the network delivers worker-a's message for %s, stamped with epoch %d", zombieOrder.ID, stamp.Epoch))
	z.wakeUp()
	var zres zombieResult
	select {
	case zres = <-z.done:
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(time.Minute):
		return res, errors.New("worker-a's late publish did not return within a minute")
	}
	tr.mu.Lock()
	var drop *sink.Decision
	for i := range tr.dropped {
		if tr.dropped[i].Stamp.Key == stamp.Key && tr.dropped[i].Stamp.Epoch == stamp.Epoch {
			drop = &tr.dropped[i]
		}
	}
	tr.mu.Unlock()
	if drop == nil || !errors.Is(drop.Err, leasehold.ErrStaleEpoch) {
		return res, fmt.Errorf("the middleware did not drop worker-a's late message (its publish returned %v)", zres.late)
	}
	s.say("The middleware dropped it, acked, without calling the handler:")
	s.say("  %v", drop.Err)
	if zres.late == nil {
		s.say("worker-a's Publish returned nil: the middleware acks what it drops, so the")
		s.say("publisher cannot know. The downstream decides, not the zombie.")
	} else {
		s.say("worker-a's Publish returned: %v", zres.late)
	}
	s.say("worker-a's handler, back from its stuck Publish, publishes again:")
	s.say("  refused before anything was published: %v", zres.retry)
	s.say("  errors.Is(err, leasehold.ErrLeaseLost) = %t", errors.Is(zres.retry, leasehold.ErrLeaseLost))

	// 8. Both workers stop; the downstream says what happened.
	if err := a.stop(); err != nil {
		return res, fmt.Errorf("worker-a: %w", err)
	}
	if err := b.stop(); err != nil {
		return res, fmt.Errorf("worker-b: %w", err)
	}
	s.step("final state downstream")
	tr.mu.Lock()
	shipped := tr.shippedBy()
	var zombieShip shipment
	for _, sh := range tr.shipments {
		if sh.Order == zombieOrder.ID && !sh.Repeat {
			zombieShip = sh
		}
	}
	orderCount := len(tr.byKeyOrders())
	res.shipments = append([]shipment(nil), tr.shipments...)
	res.dropped = append([]sink.Decision(nil), tr.dropped...)
	tr.mu.Unlock()
	s.say("%s shipped, each once", count(orderCount, "order"))
	for _, w := range []string{"worker-a", "worker-b"} {
		list := strings.Join(sortOrders(shipped[w]), ", ")
		if list == "" {
			list = "(none)"
		}
		s.say("  from %s: %s", w, list)
	}
	s.say("%s: shipped from %s under epoch %d", zombieOrder.ID, zombieShip.Stamp.Worker, zombieShip.Stamp.Epoch)
	s.say("stale messages dropped by the middleware: %d (partition %d)", fencer.Dropped(leasehold.FenceID{Scope: cfg.Prefix, Partition: zombieOrder.Partition}), zombieOrder.Partition)
	return res, s.err
}
