package httpsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
)

// Relay delivers admitted effects as HTTP requests while it holds its
// lock. Deliver and DeliverBatch are a stream sink runner's Handler and
// BatchHandler; Run holds the lock, RunSink runs a runner under it.
type Relay struct {
	cfg    Config
	client *http.Client
	eps    map[string]*endpoint
	log    *slog.Logger
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	count  metric.Int64Counter

	mu      sync.Mutex
	running bool
	lease   *coordinator.Lease // the lock while held
	changed chan struct{}      // closed and replaced when lease changes
	endTerm context.CancelCauseFunc
	waitErr error // why the last campaign failed, while not held
	stale   int   // terms in a row a receiver superseded before any delivery
	runner  *streamsink.Runner

	// acked holds the effects (scope and key) a receiver took in a
	// BatchHandler call that failed as a whole: the runner hands the
	// batch over again one effect per call, and those need no second
	// request. An effect's scope and key name it for life, so an entry is
	// never wrong, only bounded.
	ackMu sync.Mutex
	acked map[string]struct{}
}

// maxAcked bounds Relay.acked.
const maxAcked = 1 << 14

// maxStaleTerms bounds the terms in a row that receivers may refuse as
// superseded: the lease bucket issues each new term an epoch above every
// earlier one, so a receiver that keeps refusing records relay epochs
// this bucket never issued. Terms refused before any delivery to any
// endpoint stop the relay (Run); terms one endpoint refused while another
// took requests fence that endpoint out (Relay.fencedOut).
const maxStaleTerms = 3

// maxFailedCampaigns bounds the campaigns in a row that fail without an
// answer from the server, as coordinator.RunSingleton does.
const maxFailedCampaigns = 10

// New builds a relay. It sends nothing until Run holds its lock.
func New(cfg Config) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("httpsink: invalid config: %w", err)
	}
	cfg.setDefaults()
	eps, _ := cfg.endpoints()
	client, err := cfg.client()
	if err != nil {
		return nil, err
	}
	tp, mp, prop := cfg.Telemetry.TracerProvider, cfg.Telemetry.MeterProvider, cfg.Telemetry.Propagator
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	}
	meter := mp.Meter(telemetry.ScopeName)
	count, err := meter.Int64Counter("leasehold.http.requests", metric.WithUnit("{request}"),
		metric.WithDescription("Requests a relay sent, by sink, endpoint and outcome: delivered, retry, permanent, superseded, in_progress."))
	if err != nil {
		return nil, fmt.Errorf("httpsink: metrics: %w", err)
	}
	down, err := meter.Int64ObservableGauge("leasehold.http.endpoint.down",
		metric.WithDescription("1 for each endpoint of a relay that has failed every request since its last answer (no response, or a 5xx), or is fenced out (its receiver refused every relay epoch); Ready says since when and why."))
	if err != nil {
		return nil, fmt.Errorf("httpsink: metrics: %w", err)
	}
	if _, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for name, ep := range eps {
			v := int64(0)
			if ep.health.down() {
				v = 1
			}
			o.ObserveInt64(down, v, metric.WithAttributes(telemetry.AttrSink.String(cfg.Name), attribute.String("leasehold.endpoint", name)))
		}
		return nil
	}, down); err != nil {
		return nil, fmt.Errorf("httpsink: metrics: %w", err)
	}
	h := make(http.Header, len(cfg.Header))
	for k, vs := range cfg.Header {
		h[http.CanonicalHeaderKey(k)] = append([]string(nil), vs...)
	}
	cfg.Header = h
	return &Relay{
		cfg: cfg, client: client, eps: eps, log: cfg.Logger.With(slog.String("relay", cfg.Name)),
		tracer: tp.Tracer(telemetry.ScopeName), prop: prop, count: count,
		changed: make(chan struct{}), acked: map[string]struct{}{},
	}, nil
}

// Lease returns the relay's lock while it holds it, and nil otherwise.
func (r *Relay) Lease() *coordinator.Lease {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lease
}

// Runner returns the runner RunSink runs in the current term, or nil.
func (r *Relay) Runner() *streamsink.Runner {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runner
}

// Run campaigns for the relay's lock (Config.Lock) and, while it holds
// it, calls fn (when not nil) with a context that ends when the lock is
// lost, when a receiver answers that a newer relay's epoch is recorded
// (ErrRelaySuperseded), or when ctx ends; then it releases the lock if it
// still has it and campaigns again. Deliver and DeliverBatch send only
// while the lock is held, stamped with its epoch. Run returns nil when
// ctx ends, fn's error when fn fails while the lock is held, and an error
// when campaigns keep failing without an answer from the server, or
// receivers keep refusing every new epoch before any delivery
// (maxStaleTerms). A receiver that refuses every new epoch while other
// endpoints take them stops nothing: that endpoint is fenced out, and its
// effects go to the dead-letter stream (see Deliver). One Run at a time.
func (r *Relay) Run(ctx context.Context, fn func(ctx context.Context) error) error {
	r.mu.Lock()
	if r.running {
		r.mu.Unlock()
		return errors.New("httpsink: Run is already running")
	}
	r.running = true
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.running = false
		r.mu.Unlock()
	}()
	failed := 0
	for {
		l, err := r.cfg.Coordinator.Lock(ctx, r.cfg.Lock, r.cfg.LockOptions...)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			r.mu.Lock()
			r.waitErr = err
			r.mu.Unlock()
			if failed++; failed >= maxFailedCampaigns {
				return fmt.Errorf("httpsink: relay %s: lock %q: %d campaigns in a row failed, the last: %w", r.cfg.Name, r.cfg.Lock, failed, err)
			}
			r.log.Warn("httpsink: campaign for the relay lock failed; campaigning again", "lock", r.cfg.Lock, "failures", failed, "err", err)
			if err := sleep(ctx, min(time.Duration(failed)*200*time.Millisecond, 2*time.Second)); err != nil {
				return nil
			}
			continue
		}
		failed = 0
		ferr, cause := r.term(ctx, l, fn)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case errors.Is(cause, ErrRelaySuperseded):
			r.mu.Lock()
			r.stale++
			stale := r.stale
			r.mu.Unlock()
			if stale >= maxStaleTerms {
				return fmt.Errorf("httpsink: relay %s: receivers refused %d terms in a row as superseded before any delivery: they record relay epochs of scope %s above any this lease bucket issued; check that every relay of lock %q uses one lease bucket, and the receivers' stores: %w",
					r.cfg.Name, stale, l.Info().Scope, r.cfg.Lock, cause)
			}
		case l.Err() != nil && !errors.Is(l.Err(), coordinator.ErrReleased):
			r.log.Warn("httpsink: the relay lost its lock; campaigning again", "lock", r.cfg.Lock, "epoch", l.Epoch(), "cause", l.Err())
		case ferr != nil:
			return ferr
		case fn != nil:
			return nil // fn ended on its own while the lock was held
		}
	}
}

// term holds lease l: it publishes it for deliveries, runs fn under it,
// and takes it back. It returns fn's error and why the term's context
// ended.
func (r *Relay) term(ctx context.Context, l *coordinator.Lease, fn func(context.Context) error) (ferr, cause error) {
	tctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(l.Context(), func() { cancel(context.Cause(l.Context())) })
	r.mu.Lock()
	r.lease, r.endTerm, r.waitErr = l, cancel, nil
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	info := l.Info()
	r.log.Info("httpsink: the relay holds its lock and delivers", "lock", r.cfg.Lock, "scope", info.Scope, "epoch", info.Epoch, "worker", info.Holder)
	if fn != nil {
		ferr = fn(tctx)
	} else {
		<-tctx.Done()
	}
	stop()
	cancel(nil)
	cause = context.Cause(tctx)
	r.mu.Lock()
	r.lease, r.endTerm, r.runner = nil, nil, nil
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	if l.Err() == nil {
		// Superseded, fn ended, or ctx ended: hand the lock on at once.
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		if err := l.Release(rctx); err != nil && !errors.Is(err, leasehold.ErrLeaseLost) {
			r.log.Warn("httpsink: releasing the relay lock failed; it expires on its own", "lock", r.cfg.Lock, "err", err)
		}
		rcancel()
	}
	return ferr, cause
}

// supersede ends the term of lease l, if it is still the current one,
// because a receiver recorded a newer relay epoch.
func (r *Relay) supersede(l leasehold.Lease, ref Refusal) {
	r.mu.Lock()
	cur, end := r.lease, r.endTerm
	r.mu.Unlock()
	if cur == nil || cur.Info().Acquisition != l.Acquisition || end == nil {
		return
	}
	r.log.Warn("httpsink: a receiver refused this relay's epoch: a newer relay delivers; this one stops delivering",
		"lock", r.cfg.Lock, "epoch", l.Epoch, "recorded", ref.Max, "holder", ref.Holder)
	end(fmt.Errorf("%w: %s", ErrRelaySuperseded, ref.String()))
}

// delivered notes a delivery under the current term.
func (r *Relay) delivered() {
	r.mu.Lock()
	r.stale = 0
	r.mu.Unlock()
}

// fencedOut counts a refusal by ep's receiver of relay lease relay as
// superseded, and reports whether ep is fenced out: its receiver refused
// maxStaleTerms terms in a row (reset only by a request it took), and
// another endpoint took a request under the first of them or a later one,
// while relay is still the relay's lease. The relay then holds its
// lock rightly and that receiver records relay epochs the lease bucket
// never issued: ending the term again would only churn the lock, so the
// effect fails for good instead, and ep is down until its receiver takes
// a request. why says so, for the dead letter. Refusals that no other
// endpoint's delivery contradicts end the term, and Run stops after
// maxStaleTerms of them.
func (r *Relay) fencedOut(ep *endpoint, relay leasehold.Lease, ref Refusal) (why string, fenced bool) {
	n, first, last := ep.health.refusedTerm(relay.Epoch)
	if n < maxStaleTerms || !r.holds(relay) {
		return "", false
	}
	tookElsewhere := false
	for _, o := range r.eps {
		if o != ep && o.health.tookSince(first) {
			tookElsewhere = true
		}
	}
	if !tookElsewhere {
		return "", false
	}
	why = fmt.Sprintf("the receiver refused every relay epoch: %d terms in a row (epochs %d to %d) while other endpoints took them; it records relay epoch %d (holder %q), which this lease bucket never issued: fix its fence store, then replay its dead letters",
		n, first, last, ref.Max, excerpt([]byte(ref.Holder), 64))
	if ep.health.fence(why) {
		r.log.Error("httpsink: a receiver refuses every epoch of this relay while other endpoints take them; its effects go to the dead-letter stream and /readyz fails until it takes one",
			"endpoint", ep.name, "origin", ep.origin, "terms", n, "recorded", ref.Max)
	}
	r.report(ep)
	return why, true
}

// holds reports whether relay is the lease the relay holds now.
func (r *Relay) holds(relay leasehold.Lease) bool {
	r.mu.Lock()
	l := r.lease
	r.mu.Unlock()
	return l != nil && l.Err() == nil && l.Info().Acquisition == relay.Acquisition
}

// holding waits until the relay holds its lock and returns it: a relay
// that does not hold it delivers nothing. It waits as long as ctx allows;
// Ready says why it waits.
func (r *Relay) holding(ctx context.Context) (*coordinator.Lease, error) {
	for {
		r.mu.Lock()
		l, ch := r.lease, r.changed
		r.mu.Unlock()
		if l != nil && l.Err() == nil {
			return l, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-ch:
		}
	}
}

// Ready returns nil while the relay holds its lock, its runner (under
// RunSink) is ready, and no endpoint has failed every request since its
// last success: for a readiness probe. A relay waiting for its lock is
// not ready, and says who holds it.
func (r *Relay) Ready(ctx context.Context) error {
	r.mu.Lock()
	l, rn, waitErr := r.lease, r.runner, r.waitErr
	r.mu.Unlock()
	var errs []error
	if l == nil || l.Err() != nil {
		why := "it is campaigning"
		if waitErr != nil {
			why = "its last campaign failed: " + waitErr.Error()
		} else if h, ok, err := r.cfg.Coordinator.LockHolder(ctx, r.cfg.Lock); err == nil && ok {
			why = fmt.Sprintf("%s holds it at epoch %d", h.Holder, h.Epoch)
		}
		errs = append(errs, fmt.Errorf("httpsink: relay %s does not hold its lock %q, so it delivers nothing: %s", r.cfg.Name, r.cfg.Lock, why))
	}
	if rn != nil {
		if err := rn.Ready(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	for _, name := range sortedNames(r.eps) {
		if err := r.eps[name].health.ready(name, r.eps[name].origin); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// EndpointHealth is what Config.OnEndpoint hears of an endpoint.
type EndpointHealth struct {
	Relay    string // Config.Name
	Endpoint string // the endpoint's name
	Origin   string // scheme://host[:port]: no path or query, which may hold a secret
	// Down: every request since the last answer failed, or the endpoint
	// is fenced out (its receiver refused every relay epoch), since Since,
	// Fails of them, the last with Err. Up again: Since is the answer's
	// time.
	Down  bool
	Since time.Time
	Fails int
	Err   string
}

// report tells Config.OnEndpoint how ep is.
func (r *Relay) report(ep *endpoint) {
	if r.cfg.OnEndpoint == nil {
		return
	}
	ep.health.mu.Lock()
	h := EndpointHealth{Relay: r.cfg.Name, Endpoint: ep.name, Origin: ep.origin, Down: ep.health.failing, Since: ep.health.since, Fails: ep.health.fails, Err: ep.health.last}
	ep.health.mu.Unlock()
	if !h.Down {
		h.Since = time.Now()
	}
	r.cfg.OnEndpoint(h)
}

// answered records an answer that says ep's receiver is up, and reports
// it when ep was down.
func (r *Relay) answered(ep *endpoint) (back bool) {
	if back = ep.health.answered(); back {
		r.report(ep)
	}
	return back
}

// health is what the relay knows of one endpoint's receiver.
type health struct {
	mu        sync.Mutex
	failing   bool
	since     time.Time // of the first failure in a row
	fails     int
	last      string
	notBefore time.Time // a 429's Retry-After

	// Relay epochs: the highest the receiver took a request under, and
	// the terms in a row it refused as superseded since (refused, the
	// first and the last of their epochs). fenced: refused past the
	// bound while other endpoints took requests (Relay.fencedOut).
	tookEpoch                 leasehold.Epoch
	refused                   int
	firstRefused, lastRefused leasehold.Epoch
	fenced                    bool
}

// failed records a request that got no answer, or a 5xx.
func (h *health) failed(why string) (first bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	first = !h.failing
	if first {
		h.failing, h.since, h.fails = true, time.Now(), 0
	}
	h.fails++
	h.last = why
	return first
}

// answered records an answer that says the receiver is up (any but a
// 5xx). A fenced receiver stays down until it takes a request (took).
func (h *health) answered() (back bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fenced {
		return false
	}
	back = h.failing
	h.failing, h.fails, h.last = false, 0, ""
	return back
}

// took records a request the receiver took (2xx) under relay epoch ep: it
// ends a run of refused terms, and the fence.
func (h *health) took(ep leasehold.Epoch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.tookEpoch = max(h.tookEpoch, ep)
	h.refused, h.fenced = 0, false
}

// tookSince reports whether the receiver took a request under relay epoch
// ep or a later one.
func (h *health) tookSince(ep leasehold.Epoch) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.refused == 0 && h.tookEpoch >= ep
}

// refusedTerm counts a refusal of relay epoch ep as superseded: one per
// term (epoch). It returns the terms in a row refused and the first and
// last of their epochs.
func (h *health) refusedTerm(ep leasehold.Epoch) (n int, first, last leasehold.Epoch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ep > h.lastRefused {
		if h.refused == 0 {
			h.firstRefused = ep
		}
		h.refused++
		h.lastRefused = ep
	}
	return h.refused, h.firstRefused, h.lastRefused
}

// fence marks the receiver fenced out and down, for why.
func (h *health) fence(why string) (first bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	first = !h.fenced
	if !h.failing {
		h.failing, h.since, h.fails = true, time.Now(), 0
	}
	h.fenced = true
	h.fails++
	h.last = why
	return first
}

// down reports whether every request since the last answer failed.
func (h *health) down() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.failing
}

func (h *health) ready(name, origin string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fenced {
		return fmt.Errorf("httpsink: endpoint %s (%s) is fenced out: its effects go to the dead-letter stream until it takes one (%d refused for %v): %s",
			name, origin, h.fails, time.Since(h.since).Round(time.Second), h.last)
	}
	if h.failing {
		return fmt.Errorf("httpsink: endpoint %s (%s) has failed every request for %v (%d tries), the last: %s",
			name, origin, time.Since(h.since).Round(time.Second), h.fails, h.last)
	}
	if d := time.Until(h.notBefore); d > 0 {
		return fmt.Errorf("httpsink: endpoint %s (%s) asked the relay to wait %v (429 Retry-After)", name, origin, d.Round(time.Second))
	}
	return nil
}

// wait waits until a 429's Retry-After has passed, or ctx ends.
func (h *health) wait(ctx context.Context) error {
	h.mu.Lock()
	d := time.Until(h.notBefore)
	h.mu.Unlock()
	if d <= 0 {
		return nil
	}
	return sleep(ctx, d)
}

func (h *health) backOff(d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if t := time.Now().Add(d); t.After(h.notBefore) {
		h.notBefore = t
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
