// Package workertest runs job handlers in tests, in memory, with no NATS
// server: a worker.Handler or a worker.Mux gets jobs enqueued with a real
// worker.Producer, and runs them as a worker holding the partition would,
// through the worker's own code (worker.InMemory).
//
// The contract:
//
//   - A job runs under a lease the test chooses (Config.Lease: the epoch,
//     the acquisition and the holder; the scope is the prefix and the
//     partition the job's). Its effects carry the same headers as a
//     worker's: the stamp (Leasehold-Scope, -Partition, -Epoch,
//     -Acquisition, -Key, -Worker), the job and attempt marks, the final
//     of each subject, and a Nats-Msg-Id made of the key, the epoch and the
//     attempt's nonce. Keys derive from the job's origin, so a test can
//     check that a re-run emits the keys it emitted before.
//   - An attempt's error is classified as the worker classifies it: a
//     Permanent error, a payload that does not decode or a job of a kind
//     the Mux does not serve is dead-lettered at once; any other error is
//     retried up to MaxAttempts (the kind's, then the worker's), recording
//     the backoff the worker would wait without waiting it; a panic is a
//     failed attempt; a handler that outlives HandleTimeout fails with
//     worker.ErrHandleTimeout; worker.Snooze runs the job again without
//     counting an attempt, up to MaxSnoozes; an error matching
//     leasehold.ErrStaleEpoch or
//     leasehold.ErrLeaseLost stops the partition (Result.Stopped). The dead
//     letter is the message the worker would store.
//   - Every publish is stored and acknowledged at once. Nothing is fenced,
//     no progress is committed, no barrier is written and no size is
//     checked against a server's max payload: those need the real thing
//     (testing/natstest). Effects a handler writes to a sink with Job.Apply
//     go to the sink it names (sink.NewMemory keeps them).
//   - Jobs run one at a time, in the order they were enqueued; Run and
//     Work run the job they enqueue and the jobs enqueued before it.
package workertest

import (
	"context"
	"log/slog"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Config configures a Harness.
type Config struct {
	// Handler handles the jobs: a *worker.Mux, or any worker.Handler.
	// Required.
	Handler worker.Handler
	// Worker is the rest of the configuration the handler runs under, as
	// for worker.New: Prefix (default "test"), Partitions (default 1),
	// Middleware, MaxAttempts, Backoff, HandleTimeout, PartitionConcurrency
	// and Order (which decide whether finals carry a floor), Observer,
	// Telemetry and Logger (default: logs nothing). Its Handler is
	// Config.Handler; its connection, lease bucket, coordinator and fences
	// are not used.
	Worker worker.Config
	// Lease is the lease every job runs under, with the job's partition
	// filled in: Epoch (default 1), Acquisition (default "workertest") and
	// Holder (default "workertest") are stamped on every effect. Scope
	// defaults to the prefix.
	Lease leasehold.Lease
}

// Harness runs jobs in memory. Its methods fail the test they were given
// on errors of the harness itself (an enqueue refused, no job to run); what
// the handler does is in the Result.
type Harness struct {
	t testing.TB
	m *worker.InMemory

	mu     sync.Mutex
	events []worker.Event
}

// New returns a Harness that runs cfg.Handler.
func New(t testing.TB, cfg Config) *Harness {
	t.Helper()
	wc := cfg.Worker
	wc.Handler = cfg.Handler
	if wc.Prefix == "" {
		wc.Prefix = "test"
	}
	if wc.Partitions == 0 {
		wc.Partitions = 1
	}
	if wc.Logger == nil {
		wc.Logger = slog.New(slog.DiscardHandler)
	}
	h := &Harness{t: t}
	user := wc.Observer
	wc.Observer = worker.ObserverFunc(func(ctx context.Context, e worker.Event) {
		h.mu.Lock()
		h.events = append(h.events, e)
		h.mu.Unlock()
		if user != nil {
			user.WorkerEvent(ctx, e)
		}
	})
	l := cfg.Lease
	if l.Epoch == 0 {
		l.Epoch = 1
	}
	if l.Acquisition == "" {
		l.Acquisition = "workertest"
	}
	if l.Holder == "" {
		l.Holder = "workertest"
	}
	m, err := worker.NewInMemory(wc, l)
	if err != nil {
		t.Fatalf("workertest: %v", err)
	}
	h.m = m
	return h
}

// Producer enqueues jobs into the harness's job stream in memory, as a
// producer of the configured prefix and partitions does. Delayed and
// periodic jobs need a server and are refused.
func (h *Harness) Producer() *worker.Producer { return h.m.Producer() }

// Lease is the lease partition p's jobs run under: what their effects are
// stamped with.
func (h *Harness) Lease(p leasehold.Partition) leasehold.Lease { return h.m.Lease(p) }

// Events is every worker event so far, in order.
func (h *Harness) Events() []worker.Event {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]worker.Event(nil), h.events...)
}

// Published is every message published so far beside jobs, in order:
// effects, abort markers and dead letters.
func (h *Harness) Published() []*nats.Msg { return h.m.Published() }

// Effects is every effect published so far, by every attempt of every
// job, in order; abort markers and dead letters are left out.
func (h *Harness) Effects() []Effect { return effectsOf(h.m.Published()) }

// Pending is the number of jobs enqueued and not run yet.
func (h *Harness) Pending() int { return h.m.Pending() }

// Lose ends partition p's lease with cause, as a lost lease does: a
// running handler's context is cancelled, emitting fails with an error
// matching leasehold.ErrLeaseLost, and the job's Result says Stopped. Later
// jobs of the partition stop at once.
func (h *Harness) Lose(p leasehold.Partition, cause error) { h.m.Lose(p, cause) }

// Enqueue enqueues data as an untyped job under key (which picks the
// partition and the order key), failing the test if it is refused.
func (h *Harness) Enqueue(ctx context.Context, key, data []byte, opts ...worker.EnqueueOption) worker.Enqueued {
	h.t.Helper()
	e, err := h.m.Producer().Enqueue(ctx, key, data, opts...)
	if err != nil {
		h.t.Fatalf("workertest: enqueue: %v", err)
	}
	return e
}

// Enqueue encodes v as a job of kind, as worker.Enqueue does, failing the
// test if it is refused.
func Enqueue[T any](ctx context.Context, h *Harness, kind string, v T, opts ...worker.EnqueueOption) worker.Enqueued {
	h.t.Helper()
	e, err := worker.Enqueue(ctx, h.m.Producer(), kind, v, opts...)
	if err != nil {
		h.t.Fatalf("workertest: enqueue a job of kind %q: %v", kind, err)
	}
	return e
}

// Next runs the earliest job enqueued and not run yet to its end, as the
// worker would: attempts until one succeeds, the job is dead-lettered, or
// the partition stops. It fails the test when no job waits.
func (h *Harness) Next(ctx context.Context) *Result {
	h.t.Helper()
	r, ok := h.m.Next(ctx)
	if !ok {
		h.t.Fatalf("workertest: no job waits to run")
	}
	return &Result{InMemoryResult: r, t: h.t}
}

// Drain runs every job waiting, and those the handlers enqueue meanwhile,
// at most max of them (it fails the test if more wait, which a handler
// that always enqueues another job would make endless).
func (h *Harness) Drain(ctx context.Context, max int) []*Result {
	h.t.Helper()
	var out []*Result
	for {
		r, ok := h.m.Next(ctx)
		if !ok {
			return out
		}
		if len(out) == max {
			h.t.Fatalf("workertest: more than %d jobs ran and more wait", max)
		}
		out = append(out, &Result{InMemoryResult: r, t: h.t})
	}
}

// Run enqueues data under key and runs it, and the jobs enqueued before it,
// returning its Result.
func (h *Harness) Run(ctx context.Context, key, data []byte, opts ...worker.EnqueueOption) *Result {
	h.t.Helper()
	return h.runTo(ctx, h.Enqueue(ctx, key, data, opts...))
}

// Work enqueues v as a job of kind and runs it, and the jobs enqueued
// before it, returning its Result.
func Work[T any](ctx context.Context, h *Harness, kind string, v T, opts ...worker.EnqueueOption) *Result {
	h.t.Helper()
	return h.runTo(ctx, Enqueue(ctx, h, kind, v, opts...))
}

func (h *Harness) runTo(ctx context.Context, e worker.Enqueued) *Result {
	h.t.Helper()
	if e.Duplicate {
		h.t.Fatalf("workertest: job %s was enqueued before (sequence %d): it runs once", e.ID, e.Seq)
	}
	for {
		r := h.Next(ctx)
		if r.Seq == e.Seq {
			return r
		}
	}
}
