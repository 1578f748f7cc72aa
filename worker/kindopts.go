package worker

import (
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
)

// A kind may run under settings of its own: a job that sends an email can
// take ten attempts an hour apart, a job that charges a card one attempt
// of ten seconds, on the same worker. Options given to Handle, HandleWith
// or Mux.HandleKind apply to the jobs of that kind; what they leave unset
// is the worker's (Config.MaxAttempts, Backoff, HandleTimeout, Order,
// MaxSnoozes). They take effect where the Mux is Config.Handler, the
// middleware in Config.Middleware: the worker finds the kind's options
// there. A Mux wrapped by hand is out of its view: it logs a warning, once,
// and its kinds run under the worker's settings. Jobs the
// Mux dead-letters at once (an unknown kind, a payload that does not
// decode) do so whatever the options.
//
// Kinds still share the partition's lease and fence, and a job waiting
// out its backoff holds its place in its order (its key's lane, or the
// partition), whatever its kind.

// KindOption sets one setting of a kind (see Handle).
type KindOption func(*kindOptions)

// kindOptions are a kind's settings; zero values are the worker's.
type kindOptions struct {
	maxAttempts int
	backoff     func(attempt int) time.Duration
	timeout     time.Duration
	order       Order
	ordered     bool // order is set
	maxSnoozes  int  // see MaxSnoozes (snooze.go)
	snoozesSet  bool
}

// MaxAttempts sets how many failed attempts a job of the kind gets before
// it is dead-lettered, instead of Config.MaxAttempts. It panics on n < 1.
func MaxAttempts(n int) KindOption {
	if n < 1 {
		panic(fmt.Sprintf("worker: MaxAttempts(%d): use at least 1", n))
	}
	return func(o *kindOptions) { o.maxAttempts = n }
}

// Backoff sets the wait after failed attempt n (1, 2, ...) of a job of
// the kind, instead of Config.Backoff. It panics on nil.
func Backoff(f func(attempt int) time.Duration) KindOption {
	if f == nil {
		panic("worker: Backoff(nil)")
	}
	return func(o *kindOptions) { o.backoff = f }
}

// Timeout bounds one attempt at a job of the kind, instead of
// Config.HandleTimeout; past it the handler's context is cancelled with a
// cause matching ErrHandleTimeout, and the attempt fails. It panics on
// d <= 0.
func Timeout(d time.Duration) KindOption {
	if d <= 0 {
		panic(fmt.Sprintf("worker: Timeout(%v): use a positive duration", d))
	}
	return func(o *kindOptions) { o.timeout = d }
}

// KindOrder sets the order jobs of the kind keep among the jobs their
// partition runs at once, instead of Config.Order: OrderKey runs them
// after the earlier jobs of their order key; OrderPartition makes each
// wait for every earlier job of the partition, and no later job start
// before it returns; OrderNone runs them beside any other job. It matters
// only where a partition runs several jobs at once (Config.Order is not
// OrderPartition, and PartitionConcurrency is above 1). It panics on an
// order that is none of those.
func KindOrder(order Order) KindOption {
	if order < OrderKey || order > OrderNone {
		panic(fmt.Sprintf("worker: KindOrder(%d): use OrderKey, OrderPartition or OrderNone", int(order)))
	}
	return func(o *kindOptions) { o.order, o.ordered = order, true }
}

func newKindOptions(opts []KindOption) kindOptions {
	var o kindOptions
	for _, opt := range opts {
		if opt == nil {
			panic("worker: nil KindOption")
		}
		opt(&o)
	}
	return o
}

// kindOptions are the options of the kind of a job with headers h, if
// the worker's handler is a Mux that has any for it.
func (w *Worker) kindOptions(h nats.Header) (kindOptions, bool) {
	m, ok := w.cfg.Handler.(*Mux)
	if !ok {
		return kindOptions{}, false
	}
	vs := headerValues(h, HeaderKind)
	if len(vs) != 1 {
		return kindOptions{}, false
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	o, ok := m.options[vs[0]]
	return o, ok
}

// checkPlace says once, as a warning, that the kinds' options of m are
// not applied: m runs job, and the worker's Config.Handler is not m (a
// handler wrapped it by hand, where Config.Middleware would have kept it
// in view).
func (m *Mux) checkPlace(job *Job) {
	if job.r == nil || job.r.w.cfg.Handler == Handler(m) {
		return
	}
	m.mu.RLock()
	n := len(m.options)
	m.mu.RUnlock()
	if n == 0 {
		return
	}
	m.misplaced.Do(func() {
		job.r.w.log.Warn("a Mux whose kinds have options (MaxAttempts, Backoff, Timeout, KindOrder, MaxSnoozes) is not the worker's Config.Handler: those options are not applied, and the worker's settings are; pass the Mux as Config.Handler and its wrappers as Config.Middleware")
	})
}

// maxAttempts is the attempts a job gets.
func (r *runner) maxAttempts(job *Job) int {
	if o, ok := r.w.kindOptions(job.Header); ok && o.maxAttempts > 0 {
		return o.maxAttempts
	}
	return r.w.cfg.MaxAttempts
}

// backoff is the wait after failed attempt n of job.
func (r *runner) backoff(job *Job, n int) time.Duration {
	if o, ok := r.w.kindOptions(job.Header); ok && o.backoff != nil {
		return o.backoff(n)
	}
	return r.w.cfg.Backoff(n)
}

// timeout bounds an attempt at job.
func (r *runner) timeout(job *Job) time.Duration {
	if o, ok := r.w.kindOptions(job.Header); ok && o.timeout > 0 {
		return o.timeout
	}
	return r.w.cfg.HandleTimeout
}

// laneOf is the lane of the job at seq with headers h: its kind's order,
// or the partition's.
func (r *runner) laneOf(seq uint64, h nats.Header) laneKey {
	o, ok := r.w.kindOptions(h)
	if !ok || !o.ordered || o.order == r.policy.order || r.policy.order == OrderPartition {
		return laneOf(r.policy.order, seq, h, r.badOrderKey)
	}
	if o.order == OrderPartition {
		// Under another order, laneOf(OrderPartition) would be one lane of
		// its own: this kind waits for every job before it instead.
		return laneKey{kind: lanePartition}
	}
	return laneOf(o.order, seq, h, r.badOrderKey)
}
