package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/telemetry"
)

// Worker takes its share of a job stream's partitions through the lease
// bucket and runs the jobs of each partition it holds.
type Worker struct {
	cfg     Config
	tel     *telemetry.Telemetry
	handler Handler
	pool    *pool // slots for the jobs beyond each partition's first (slots.go)
	log     *slog.Logger
	ttl     time.Duration
	jobs    jetstream.Stream // set by Run, for trimming

	mu      sync.Mutex
	runners map[leasehold.Partition]*runner
	tasks   sync.WaitGroup // runner goroutines
	state   runState
	stop    context.CancelFunc
	stopped chan struct{} // closed when Run returns

	stalls   atomic.Int64 // pull requests that expired while jobs waited
	subjects breakers     // effect subjects found without a stream (breaker.go)

	hangs map[leasehold.Partition]hangRecord // jobs whose handler hung here; guarded by mu

	cancelFeed *cancelFeed // the watch on the bucket of cancels (cancelfeed.go)
}

type runState int

const (
	stateNew runState = iota
	stateRunning
	stateDone
)

// New checks cfg and returns a Worker; Run starts it. Every problem with
// cfg is reported at once.
func New(cfg Config) (*Worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("worker: invalid config: %w", err)
	}
	cfg.setDefaults()
	tc := cfg.Telemetry
	if tc.Propagator == nil {
		tc.Propagator = cfg.Propagator
	}
	w := &Worker{
		cfg:     cfg,
		tel:     telemetry.New(tc),
		handler: Chain(cfg.Handler, cfg.Middleware...),
		log:     cfg.Logger.With("worker", cfg.Coordinator.Worker, "prefix", cfg.Prefix),
		runners: map[leasehold.Partition]*runner{},
		stopped: make(chan struct{}),
	}
	w.pool = newPool(cfg.MaxConcurrency)
	w.cancelFeed = newCancelFeed(w)
	return w, nil
}

// ID is the worker's ID, as its leases and stamps carry it.
func (w *Worker) ID() string { return w.cfg.Coordinator.Worker }

// Run joins the worker group and handles the partitions it is given until
// ctx ends or Stop is called. Then it shuts down gracefully: it stops
// fetching, lets the running handlers finish while their leases hold,
// waits for their effects, commits progress and releases every lease, so
// that other workers take the partitions over at once. Run returns nil
// after a shutdown, and an error when it cannot start: a lease bucket or
// job stream that is missing or does not match the configuration.
func (w *Worker) Run(ctx context.Context) error {
	w.mu.Lock()
	switch w.state {
	case stateRunning:
		w.mu.Unlock()
		return errors.New("worker: Run is already running")
	case stateDone:
		w.mu.Unlock()
		return errors.New("worker: Run has returned (or Stop was called) already: create a new Worker")
	}
	ctx, cancel := context.WithCancel(ctx)
	w.state, w.stop = stateRunning, cancel
	w.mu.Unlock()
	defer func() {
		cancel()
		w.mu.Lock()
		w.state = stateDone
		w.mu.Unlock()
		close(w.stopped)
	}()

	c, err := w.start(ctx)
	if err != nil {
		return err
	}
	w.log.Info("worker starting", "partitions", w.cfg.Partitions, "ttl", c.Config().TTL)
	wctx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		w.watchStalls(wctx)
	}()
	err = c.Run(ctx)
	w.tasks.Wait()
	w.cancelFeed.close()
	stopWatch()
	<-watched
	w.log.Info("worker stopped")
	return err
}

// start binds the lease bucket and the job stream.
func (w *Worker) start(ctx context.Context) (*coordinator.Coordinator, error) {
	b := w.cfg.Bucket
	if b == nil {
		var err error
		bc := *w.cfg.ProvisionBucket
		if bc.Bucket == "" {
			bc.Bucket = w.cfg.Prefix + "-leases"
		}
		if bc.Scope == "" {
			bc.Scope = w.cfg.Prefix
		}
		if b, err = coordinator.Provision(ctx, w.cfg.JetStream, bc); err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
	}
	if err := streamPartitions(ctx, w.cfg.JetStream, w.cfg.Prefix, w.cfg.Partitions); err != nil {
		return nil, err
	}
	if err := checkScope(b, w.cfg.Prefix); err != nil {
		return nil, err
	}
	if err := w.checkBarrierSubjects(ctx); err != nil {
		return nil, err
	}
	s, err := w.cfg.JetStream.Stream(ctx, JobsStream(w.cfg.Prefix))
	if err != nil {
		return nil, fmt.Errorf("worker: bind job stream %s: %w", JobsStream(w.cfg.Prefix), err)
	}
	w.jobs = s
	cc := w.cfg.Coordinator
	cc.Partitions = w.cfg.Partitions
	cc.OnAcquire = w.onAcquire
	cc.OnRevoke = w.onRevoke
	if cc.Observer == nil {
		cc.Observer = w.tel.LeaseObserver()
	} else {
		cc.Observer = leaseObservers{w.tel.LeaseObserver(), cc.Observer}
	}
	c, err := coordinator.New(b, cc)
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	w.ttl = c.Config().TTL
	return c, nil
}

// Stop shuts the worker down as Run does when its context ends, and waits
// until Run has returned or ctx ends. It is safe to call more than once
// and from any goroutine; before Run it keeps Run from starting.
func (w *Worker) Stop(ctx context.Context) error {
	w.mu.Lock()
	switch w.state {
	case stateNew:
		w.state = stateDone
		close(w.stopped)
		w.mu.Unlock()
		return nil
	case stateRunning:
		w.stop()
	}
	w.mu.Unlock()
	select {
	case <-w.stopped:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("worker: stop: %w (the shutdown goes on)", ctx.Err())
	}
}

// Stopped is closed when Run has returned.
func (w *Worker) Stopped() <-chan struct{} { return w.stopped }

// Held returns the leases of the partitions this worker runs now, ordered
// by partition.
func (w *Worker) Held() []leasehold.Lease {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]leasehold.Lease, 0, len(w.runners))
	for _, r := range w.runners {
		if r.lease.Err() == nil {
			out = append(out, r.info)
		}
	}
	slices.SortFunc(out, func(a, b leasehold.Lease) int { return int(a.Partition) - int(b.Partition) })
	return out
}

// onAcquire starts a runner for a newly acquired partition. It must not
// block: the runner waits for the partition's previous runner, if one is
// still settling, in its own goroutine.
func (w *Worker) onAcquire(l *coordinator.Lease) {
	w.mu.Lock()
	prev := w.runners[l.Partition()]
	r := newRunner(w, l, prev)
	w.runners[l.Partition()] = r
	w.tasks.Add(1)
	w.mu.Unlock()
	r.event(r.ctx, Event{Kind: EventPartitionAcquired, Seq: l.Progress()})
	go func() {
		defer r.untrack()
		defer w.forget(r)
		r.run()
	}()
}

// onRevoke drains the partition's runner before the coordinator releases
// the lease.
func (w *Worker) onRevoke(ctx context.Context, l *coordinator.Lease) {
	w.mu.Lock()
	r := w.runners[l.Partition()]
	w.mu.Unlock()
	if r == nil || r.lease != l {
		return
	}
	r.drain(ctx)
}

func (w *Worker) forget(r *runner) {
	w.mu.Lock()
	if w.runners[r.p] == r {
		delete(w.runners, r.p)
	}
	w.mu.Unlock()
}

// checkBarrierSubjects refuses to start when a barrier subject has no
// stream: every acquisition would retry its barrier for ever.
func (w *Worker) checkBarrierSubjects(ctx context.Context) error {
	for _, subj := range w.cfg.BarrierSubjects(0) {
		byName := func(ctx context.Context) (string, error) { return w.cfg.JetStream.StreamNameBySubject(ctx, subj) }
		if _, err := retry.Value(ctx, byName); err != nil {
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				return fmt.Errorf("%w: no stream stores the barrier subject %s (a job stream provisioned with NoEffects has no default output): set Config.BarrierSubjects to return the subjects your sinks consume, or nil to publish no barriers",
					ErrStreamConfig, subj)
			}
			return fmt.Errorf("worker: look up the stream of barrier subject %s: %w", subj, err)
		}
	}
	return nil
}

// checkScope refuses a lease bucket that serves another job stream: lease
// and progress keys are per partition number, so two streams sharing one
// would share leases and, worse, resume each other's progress.
func checkScope(b *coordinator.Bucket, prefix string) error {
	if b.Scope() != prefix {
		return fmt.Errorf("%w: lease bucket %s serves job stream %q, not %q: give each job stream its own lease bucket (by default \"<prefix>-leases\")",
			ErrStreamConfig, b.Name(), b.Scope(), prefix)
	}
	return nil
}
