package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
)

// Mux routes jobs to handlers by kind, the Leasehold-Kind header its
// producer set (Enqueue, WithKind). It is a Handler: put it in
// Config.Handler, under any middleware. Kinds are routing only: a
// partition's jobs still run one at a time in order, under the partition's
// one lease and fence, whatever their kinds.
//
// A job whose kind no handler of the mux serves, or whose kind header is
// missing or malformed, fails with a Permanent error and is dead-lettered
// at once with that reason, not retried: a worker that does not know a kind
// cannot learn it by retrying. Roll out the workers that serve a new kind
// before the producers that enqueue it, or replay its dead letters
// afterwards (`leasehold dlq replay`).
type Mux struct {
	mu        sync.RWMutex
	handlers  map[string]Handler
	options   map[string]kindOptions // kinds registered with options (kindopts.go)
	fallback  Handler
	misplaced sync.Once // said that its kinds' options are not applied
}

// NewMux returns an empty Mux.
func NewMux() *Mux { return &Mux{handlers: map[string]Handler{}, options: map[string]kindOptions{}} }

// HandleKind registers h for jobs of kind, with the kind's own settings
// in opts (MaxAttempts, Backoff, Timeout, KindOrder; the worker's where
// unset); the typed Handle and HandleWith register through it. Like
// http.ServeMux, it panics on an invalid kind or a kind registered twice:
// both are programming errors found at start.
func (m *Mux) HandleKind(kind string, h Handler, opts ...KindOption) {
	if err := ValidKind(kind); err != nil {
		panic(err)
	}
	if h == nil {
		panic(fmt.Sprintf("worker: Mux.HandleKind(%q): nil handler", kind))
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, dup := m.handlers[kind]; dup {
		panic(fmt.Sprintf("worker: Mux.HandleKind(%q): the kind has a handler already", kind))
	}
	m.handlers[kind] = h
	if len(opts) > 0 {
		m.options[kind] = newKindOptions(opts)
	}
}

// HandleUnkinded registers h for jobs without a kind header: jobs enqueued
// by producers that predate kinds, or with the untyped Producer.Enqueue.
// Without it such jobs are dead-lettered.
func (m *Mux) HandleUnkinded(h Handler) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fallback = h
}

// Kinds lists the kinds the mux serves, sorted.
func (m *Mux) Kinds() []string {
	m.mu.RLock()
	defer m.mu.RUnlock()
	out := make([]string, 0, len(m.handlers))
	for k := range m.handlers {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Handle routes job to the handler of its kind.
func (m *Mux) Handle(ctx context.Context, job *Job) error {
	h, err := m.route(job)
	if err != nil {
		return err
	}
	m.checkPlace(job)
	return h.Handle(ctx, job)
}

// ErrUnknownKind is matched by the (permanent) error of a job whose kind no
// handler serves.
var ErrUnknownKind = errors.New("no handler serves the job's kind")

func (m *Mux) route(job *Job) (Handler, error) {
	if err := rollupError(job); err != nil {
		return nil, err
	}
	vals := headerValues(job.Header, HeaderKind)
	m.mu.RLock()
	defer m.mu.RUnlock()
	if len(vals) == 0 {
		if m.fallback != nil {
			return m.fallback, nil
		}
		return nil, Permanent(fmt.Errorf("job %d of partition %d has no %s header: %w; this worker serves %s",
			job.Seq, job.Partition, HeaderKind, ErrUnknownKind, m.served()))
	}
	if len(vals) > 1 {
		return nil, Permanent(fmt.Errorf("job %d of partition %d has %d %s headers; a job has one kind", job.Seq, job.Partition, len(vals), HeaderKind))
	}
	kind := vals[0]
	if err := ValidKind(kind); err != nil {
		return nil, Permanent(fmt.Errorf("job %d of partition %d: %w", job.Seq, job.Partition, err))
	}
	h, ok := m.handlers[kind]
	if !ok {
		return nil, Permanent(fmt.Errorf("job %d of partition %d is of kind %q: %w; this worker serves %s",
			job.Seq, job.Partition, kind, ErrUnknownKind, m.served()))
	}
	return h, nil
}

// rollupError refuses a job that carries Nats-Rollup, or that is itself a
// stored schedule: the worker checks it before any handler runs, a Mux
// again for a Mux used on its own.
func rollupError(job *Job) error {
	rollup := headerValues(job.Header, "Nats-Rollup")
	purged := ""
	if len(rollup) > 0 {
		// A job stream that schedules allows roll-ups; no producer of ours
		// sends one on a job subject.
		purged = "on " + job.Subject
		if strings.EqualFold(strings.TrimSpace(rollup[0]), "all") {
			// Only this partition sees it: say what the others lost.
			purged = "on every partition, and every delayed and periodic job's schedule"
		}
	}
	if sched := headerValues(job.Header, hdrSchedule); len(sched) > 0 {
		// leasehold stores schedules on subjects of their own; one on a
		// partition subject would fire at its target for as long as it is
		// stored. Its dead letter keeps it, and the worker then removes it.
		what := ""
		if purged != "" {
			what = "; the Nats-Rollup it carries purged every job stored before it " + purged + " (the purged jobs are gone, replay them from their source)"
		}
		return Permanent(fmt.Errorf("job %d of partition %d is a schedule (Nats-Schedule: %q) stored on the partition's subject, which only a forger or a mistaken publisher puts there%s; find who publishes it",
			job.Seq, job.Partition, oneLine(sched[0], 200), what))
	}
	if purged == "" {
		return nil
	}
	return Permanent(fmt.Errorf("job %d of partition %d carries a Nats-Rollup header: the server purged every job stored before it %s; find who publishes it (the purged jobs are gone, replay them from their source)",
		job.Seq, job.Partition, purged))
}

// served describes the kinds for an error message; m.mu is held.
func (m *Mux) served() string {
	ks := make([]string, 0, len(m.handlers))
	for k := range m.handlers {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	if len(ks) == 0 {
		return "no kinds"
	}
	if len(ks) > 20 {
		return fmt.Sprintf("%d kinds (%s, ...)", len(ks), strings.Join(ks[:20], ", "))
	}
	return "kinds " + strings.Join(ks, ", ")
}
