package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/worker"
)

// member is one running worker, with its own NATS connection and its own
// sink, as a separate process would have.
type member struct {
	name   string
	w      *worker.Worker
	sink   *pgsink.Sink
	nc     *nats.Conn
	cancel context.CancelFunc
	done   chan error // receives Run's result, then is closed
}

// startMember starts a worker that pays orders. shutdown bounds its drain
// when it stops (0: the default).
func startMember(ctx context.Context, cfg config, db *pgxpool.Pool, name string, shutdown time.Duration, tr *tracker, z *zombie) (*member, error) {
	nc, err := connectNATS(cfg.NATS, name)
	if err != nil {
		return nil, err
	}
	m := &member{name: name, nc: nc, done: make(chan error, 1)}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	bucket, err := coordinator.OpenBucket(ctx, js, cfg.Prefix+"-leases")
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	m.sink, err = pgsink.New(pgsink.Config{DB: db, Schema: cfg.Schema, Observer: tr.sinkObserver(name), Logger: cfg.Logger})
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	sh := &shop{
		sink:   m.sink,
		orders: pgx.Identifier{cfg.Schema, "orders"}.Sanitize(),
		accts:  pgx.Identifier{cfg.Schema, "accounts"}.Sanitize(),
		freeze: z,
	}
	m.w, err = worker.New(worker.Config{
		JetStream:  js,
		Prefix:     cfg.Prefix,
		Partitions: cfg.Partitions,
		Bucket:     bucket,
		Handler:    worker.JSON(sh.handle),
		// On acquiring a partition, the worker raises the partition's
		// fence in PostgreSQL before its first job: from then on the
		// previous holder's transactions are refused.
		Fences: []worker.Fence{m.sink},
		// Nothing is published to an effect log, so no barriers either.
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
		nc.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	m.cancel = cancel
	go func() {
		m.done <- m.w.Run(runCtx)
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

func connectNATS(url, name string) (*nats.Conn, error) {
	nc, err := nats.Connect(url, nats.Name(name))
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w (is the server up, with JetStream? pass -nats nats://host:4222)", url, err)
	}
	return nc, nil
}

// tracker follows what the workers and sinks report, so that the example
// can wait for events instead of sleeping.
type tracker struct {
	mu       sync.Mutex
	changed  chan struct{}
	epochs   map[string]map[leasehold.Partition]leasehold.Epoch // per worker: acquired epochs
	ready    map[string]map[leasehold.Partition]bool            // per worker: fenced and consuming
	released map[string]map[leasehold.Partition]bool            // per worker: leases released
	finished map[string]map[string]bool                         // per worker: orders whose job finished
	dups     map[string]int                                     // per worker: jobs found applied before
	failure  error                                              // a dead letter: the example went wrong
}

func newTracker() *tracker {
	return &tracker{
		changed:  make(chan struct{}),
		epochs:   map[string]map[leasehold.Partition]leasehold.Epoch{},
		ready:    map[string]map[leasehold.Partition]bool{},
		released: map[string]map[leasehold.Partition]bool{},
		finished: map[string]map[string]bool{},
		dups:     map[string]int{},
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
		case worker.EventJobFinished:
			var p payJob
			_ = json.Unmarshal(e.Job.Data, &p)
			t.update(func() { set(t.finished, name, p.Order, true) })
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

func (t *tracker) sinkObserver(name string) sink.Observer {
	return sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		if d.Outcome == sink.Duplicate {
			t.update(func() { t.dups[name]++ })
		}
	})
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
