package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/wmsink"
	"github.com/leasehold/leasehold/worker"
)

// frozenDrain is how long worker-a's shutdown waits for its stuck handler
// before it gives the partition up.
const frozenDrain = time.Second

type order struct {
	ID        string
	Partition leasehold.Partition
}

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

	// Watermill: an in-process pub/sub whose Publish returns once the
	// subscriber has acked, and the downstream router, whose handler the
	// fencing middleware guards.
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if cfg.Logger.Enabled(ctx, slog.LevelInfo) {
		logger = watermill.NewSlogLogger(cfg.Logger)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	defer pubsub.Close()
	// gochannel carries no log position: the middleware judges in arrival
	// order, which is safe here because nothing is redelivered.
	fencer, err := wmsink.New(wmsink.Config{ArrivalOrder: true, Name: "watermill", Observer: tr.fenceObserver(), Logger: cfg.Logger})
	if err != nil {
		return res, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return res, err
	}
	router.AddMiddleware(fencer.Middleware)
	router.AddConsumerHandler("ship", topic, pubsub, (&warehouse{tr: tr}).ship)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(context.WithoutCancel(ctx)) }()

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
		if cerr := router.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("close the router: %w", cerr)
		}
		if rerr := <-routerDone; rerr != nil && err == nil {
			err = fmt.Errorf("router: %w", rerr)
		}
	}()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return res, ctx.Err()
	}

	s.printf("leasehold example: Watermill, stamped upstream and fenced downstream\n")
	s.say("NATS        %s: job stream %s (%d partitions), lease bucket %s-leases", srv.desc, worker.JobsStream(cfg.Prefix), cfg.Partitions, cfg.Prefix)
	if leftover > 0 {
		s.say("            (purged the %s of an earlier run from the job stream)", count(int(leftover), "job"))
	}
	s.say("Watermill   a gochannel pub/sub, topic %q", topic)
	s.say("upstream    leasehold workers; each job publishes one message through")
	s.say("            wmstamp.NewPublisher(pubsub): the message is created with the handler's ctx,")
	s.say("            and the publisher writes the job's stamp into its metadata")
	s.say("            (Leasehold-Partition, Leasehold-Epoch, Leasehold-Key, Leasehold-Worker)")
	s.say("downstream  a Watermill router whose handler is wrapped in wmsink's fencing middleware;")
	s.say("            it records each shipment by its idempotency key")

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

// sortOrders sorts order IDs by number: o-2 before o-10.
func sortOrders(ids []string) []string {
	out := slices.Clone(ids)
	slices.SortFunc(out, func(a, b string) int {
		na, _ := strconv.Atoi(strings.TrimPrefix(a, "o-"))
		nb, _ := strconv.Atoi(strings.TrimPrefix(b, "o-"))
		return na - nb
	})
	return out
}

// byKeyOrders returns the orders shipped at least once; t is locked.
func (t *tracker) byKeyOrders() map[string]bool {
	out := map[string]bool{}
	for _, o := range t.byKey {
		out[o] = true
	}
	return out
}

// setUp creates the job stream and the lease bucket, and drops jobs an
// earlier run left.
func setUp(ctx context.Context, js jetstream.JetStream, cfg config) (uint64, error) {
	err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions, NoEffects: true})
	if errors.Is(err, worker.ErrStreamConfig) {
		return 0, fmt.Errorf("%w (an earlier run with other settings? pass -prefix with a new name)", err)
	}
	if err != nil {
		return 0, err
	}
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: cfg.Prefix + "-leases"}); err != nil {
		return 0, err
	}
	// Purging keeps the stream's sequence numbers, so the progress
	// recorded in the lease bucket stays valid.
	stream, err := js.Stream(ctx, worker.JobsStream(cfg.Prefix))
	if err != nil {
		return 0, err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, err
	}
	if info.State.Msgs > 0 {
		if err := stream.Purge(ctx); err != nil {
			return 0, fmt.Errorf("drop the jobs of an earlier run: %w", err)
		}
	}
	return info.State.Msgs, nil
}

func enqueue(ctx context.Context, js jetstream.JetStream, cfg config, orders []order) error {
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions})
	if err != nil {
		return err
	}
	batch := p.Batch()
	for _, o := range orders {
		data, _ := json.Marshal(shipJob{Order: o.ID})
		if err := batch.EnqueueTo(ctx, o.Partition, data); err != nil {
			return fmt.Errorf("enqueue %s: %w", o.ID, err)
		}
	}
	if _, err := batch.Wait(ctx); err != nil {
		return fmt.Errorf("enqueue the orders: %w", err)
	}
	return nil
}

// pickZombieOrder picks the order whose message hangs: the middle one of
// partition 0, so that worker-a has shipped some of the partition's orders
// before it and worker-b ships some after it.
func pickZombieOrder(orders []order) order {
	var p0 []order
	for _, o := range orders {
		if o.Partition == 0 {
			p0 = append(p0, o)
		}
	}
	return p0[len(p0)/2]
}

// ordersBefore lists the orders worker-a ships before its message hangs:
// every order of the other partitions, and those of z's partition before z.
func ordersBefore(orders []order, z order) []string {
	var ids []string
	seen := false
	for _, o := range orders {
		if o.ID == z.ID {
			seen = true
		}
		if o.Partition != z.Partition || !seen {
			ids = append(ids, o.ID)
		}
	}
	return ids
}

func hasAll(have []string, want []string) bool {
	set := map[string]bool{}
	for _, id := range have {
		set[id] = true
	}
	for _, id := range want {
		if !set[id] {
			return false
		}
	}
	return true
}

// count says "1 order", "2 orders".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
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
