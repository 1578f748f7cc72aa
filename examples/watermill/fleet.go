package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/wmstamp"
)

// member is one running worker, with its own NATS connection, as a
// separate process would have.
type member struct {
	name   string
	nc     *nats.Conn
	cancel context.CancelFunc
	done   chan error // receives Run's result, then is closed
}

// startMember starts a worker that ships orders through pub. shutdown
// bounds its drain when it stops (0: the default).
func startMember(ctx context.Context, srv *natsServer, cfg config, name string, pub message.Publisher, z *zombie, shutdown time.Duration, tr *tracker) (*member, error) {
	nc, err := srv.connect(name)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*member, error) {
		nc.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	bucket, err := coordinator.OpenBucket(ctx, js, cfg.Prefix+"-leases")
	if err != nil {
		return fail(err)
	}
	up := &upstream{
		// Every message the handler publishes gets the job's stamp.
		pub:    wmstamp.NewPublisher(&network{Publisher: pub, zombie: z}, wmstamp.Config{}),
		zombie: z,
	}
	w, err := worker.New(worker.Config{
		JetStream:  js,
		Prefix:     cfg.Prefix,
		Partitions: cfg.Partitions,
		Bucket:     bucket,
		Handler:    worker.JSON(up.handle),
		Fences:     []worker.Fence{barriers{pub: pub}},
		// Nothing goes to a JetStream effect log, so no barriers there.
		BarrierSubjects: func(leasehold.Partition) []string { return nil },
		Coordinator: coordinator.Config{
			Worker:          name,
			ShutdownTimeout: shutdown,
			RebalanceDelay:  100 * time.Millisecond,
			Observer:        tr.leaseObserver(name),
		},
		Observer: tr.workerObserver(name),
		Logger:   cfg.Logger.With("worker", name),
	})
	if err != nil {
		return fail(err)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	m := &member{name: name, nc: nc, cancel: cancel, done: make(chan error, 1)}
	go func() {
		m.done <- w.Run(runCtx)
		close(m.done)
	}()
	return m, nil
}

// stop shuts the worker down and waits for it; it is safe to call twice.
func (m *member) stop() error {
	m.cancel()
	err := <-m.done
	m.nc.Close()
	return err
}

// tracker follows what the workers, the middleware and the downstream
// handler report, so that the example can wait for events instead of
// sleeping.
type tracker struct {
	mu        sync.Mutex
	changed   chan struct{}
	epochs    map[string]map[leasehold.Partition]leasehold.Epoch // per worker: acquired epochs
	ready     map[string]map[leasehold.Partition]bool            // per worker: barriers written, consuming
	released  map[string]map[leasehold.Partition]bool            // per worker: leases released
	shipments []shipment                                         // what the downstream handler got, in order
	byKey     map[string]string                                  // idempotency key -> order
	dropped   []sink.Decision                                    // the middleware's drops
	failure   error                                              // a dead letter: the example went wrong
}

func newTracker() *tracker {
	return &tracker{
		changed:  make(chan struct{}),
		epochs:   map[string]map[leasehold.Partition]leasehold.Epoch{},
		ready:    map[string]map[leasehold.Partition]bool{},
		released: map[string]map[leasehold.Partition]bool{},
		byKey:    map[string]string{},
	}
}

// update changes the tracker's state and wakes the waiters.
func (t *tracker) update(f func()) {
	t.mu.Lock()
	f()
	close(t.changed)
	t.changed = make(chan struct{})
	t.mu.Unlock()
}

func set[K comparable, V any](m map[string]map[K]V, name string, k K, v V) {
	if m[name] == nil {
		m[name] = map[K]V{}
	}
	m[name][k] = v
}

func (t *tracker) workerObserver(name string) worker.Observer {
	return worker.ObserverFunc(func(_ context.Context, e worker.Event) {
		switch e.Kind {
		case worker.EventPartitionAcquired:
			t.update(func() { set(t.epochs, name, e.Lease.Partition, e.Lease.Epoch) })
		case worker.EventPartitionReady:
			t.update(func() { set(t.ready, name, e.Lease.Partition, true) })
		case worker.EventJobDeadLettered:
			t.update(func() {
				t.failure = fmt.Errorf("%s dead-lettered job %d of partition %d: %w", name, e.Seq, e.Lease.Partition, e.Err)
			})
		}
	})
}

type leaseObserverFunc func(context.Context, coordinator.Event)

func (f leaseObserverFunc) LeaseEvent(ctx context.Context, e coordinator.Event) { f(ctx, e) }

func (t *tracker) leaseObserver(name string) coordinator.Observer {
	return leaseObserverFunc(func(_ context.Context, e coordinator.Event) {
		if e.Kind == coordinator.EventReleased && !e.Member {
			t.update(func() { set(t.released, name, e.Lease.Partition, true) })
		}
	})
}

func (t *tracker) fenceObserver() sink.Observer {
	return sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		if d.Outcome.Dropped() {
			t.update(func() { t.dropped = append(t.dropped, d) })
		}
	})
}

// shippedBy returns the orders the downstream shipped from each worker,
// first shipments only; t is locked.
func (t *tracker) shippedBy() map[string][]string {
	out := map[string][]string{}
	for _, s := range t.shipments {
		if !s.Repeat {
			out[s.Stamp.Worker] = append(out[s.Stamp.Worker], s.Order)
		}
	}
	return out
}

// wait waits until cond, called with the tracker locked, holds.
func (t *tracker) wait(ctx context.Context, what string, cond func() bool) error {
	timeout := time.NewTimer(time.Minute)
	defer timeout.Stop()
	for {
		t.mu.Lock()
		ok, failure, ch := cond(), t.failure, t.changed
		t.mu.Unlock()
		switch {
		case failure != nil:
			return failure
		case ok:
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-timeout.C:
			return fmt.Errorf("waited a minute for %s; run with -v to see what the workers do", what)
		}
	}
}

// epochList formats a worker's epochs, by partition.
func epochList(m map[leasehold.Partition]leasehold.Epoch) string {
	var b strings.Builder
	for i, p := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d: %d", p, m[p])
	}
	return b.String()
}
