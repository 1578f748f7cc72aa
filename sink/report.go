package sink

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// DropCounter is implemented by sinks that count the effects they refused.
type DropCounter interface {
	// Dropped returns how many effects of fence id were refused for good
	// (stale, split brain, bad stamp, unverified epoch).
	Dropped(id leasehold.FenceID) uint64
}

// Reporter is what every sink in this module reports its decisions
// through: it passes each decision to the Observer, counts drops per
// partition, and logs drops at most once per partition per LogEvery, with
// the number of drops the limit held back. Sink implementations outside
// this module can use it too. The zero value is not usable; use
// NewReporter.
type Reporter struct {
	name     string
	obs      Observer
	log      *slog.Logger
	logEvery time.Duration
	now      func() time.Time

	tel         *telemetry.Telemetry
	applyOpts   []trace.SpanStartOption
	processOpts []trace.SpanStartOption
	counts      [Failed + 1][]metric.AddOption // by outcome

	// suspicious counts the messages set aside as suspicious, by reason
	// (Decision.Suspect); suspects rate-limits their log lines by reason.
	suspicious metric.Int64Counter

	mu       sync.Mutex
	parts    map[leasehold.FenceID]*dropState
	suspects map[string]*dropState

	// names holds the process spans' destination templates and names,
	// by subject and partition (see processName).
	namesMu sync.Mutex
	names   map[nameKey]processName
}

type dropState struct {
	n          atomic.Uint64
	lastLog    time.Time // guarded by Reporter.mu
	suppressed uint64    // guarded by Reporter.mu
}

// ReporterConfig configures a Reporter.
type ReporterConfig struct {
	// Name names the sink in decisions and logs. Default "sink".
	Name string
	// Observer receives every decision. Optional.
	Observer Observer
	// Logger receives drop lines. Default slog.Default().
	Logger *slog.Logger
	// LogEvery is the shortest interval between two drop lines of one
	// fence. Default one second.
	LogEvery time.Duration
	// Telemetry selects the providers of the sink's spans and metrics.
	// Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

// NewReporter returns a Reporter.
func NewReporter(cfg ReporterConfig) *Reporter {
	if cfg.Name == "" {
		cfg.Name = "sink"
	}
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.LogEvery <= 0 {
		cfg.LogEvery = time.Second
	}
	r := &Reporter{
		name: cfg.Name, obs: cfg.Observer, log: cfg.Logger, logEvery: cfg.LogEvery, now: time.Now,
		parts: make(map[leasehold.FenceID]*dropState), suspects: make(map[string]*dropState),
	}
	r.newInstruments(cfg.Telemetry)
	mp := cfg.Telemetry.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	// Instrument creation fails only for invalid names; this one is constant.
	r.suspicious, _ = mp.Meter(telemetry.ScopeName).Int64Counter("leasehold.sink.markers.suspicious",
		metric.WithDescription("Messages a sink set aside as suspicious: job markers (aborts, attempt numbers, finals) no worker writes the way they came, by reason."),
		metric.WithUnit("{message}"))
	return r
}

// Name is the sink's name.
func (r *Reporter) Name() string { return r.name }

// Report passes d to the observer, counts it in
// leasehold_sink_effects_total, records it on the span of ctx (see
// StartApply and StartProcess) and, for a drop, counts and logs it.
func (r *Reporter) Report(ctx context.Context, d Decision) {
	d.Sink = r.name
	r.obs.Decided(ctx, d)
	r.count(ctx, d.Outcome)
	r.traceDecision(ctx, &d)
	if d.Suspect != "" {
		r.reportSuspect(ctx, d)
	}
	if !d.Outcome.Dropped() {
		return
	}
	r.countRefusal(ctx, d)
	r.mu.Lock()
	id := d.Stamp.Fence()
	st := r.parts[id]
	if st == nil {
		if len(r.parts) >= maxDropStates {
			// Forged stamps can name any number of scopes: count them
			// under one entry rather than grow without bound.
			id = overflowFence
			if st = r.parts[id]; st == nil {
				st = &dropState{}
				r.parts[id] = st
			}
		} else {
			st = &dropState{}
			r.parts[id] = st
		}
	}
	st.n.Add(1)
	now := r.now()
	if !st.lastLog.IsZero() && now.Sub(st.lastLog) < r.logEvery {
		st.suppressed++
		r.mu.Unlock()
		return
	}
	suppressed := st.suppressed
	st.lastLog, st.suppressed = now, 0
	r.mu.Unlock()
	r.log.LogAttrs(ctx, slog.LevelWarn, "leasehold: effect dropped",
		slog.String("sink", r.name),
		slog.String("outcome", d.Outcome.String()),
		slog.String("scope", d.Stamp.Scope),
		slog.Uint64("partition", uint64(d.Stamp.Partition)),
		slog.Uint64("epoch", uint64(d.Stamp.Epoch)),
		slog.Uint64("max_epoch", uint64(d.Max)),
		slog.String("key", d.Stamp.Key),
		slog.String("worker", d.Stamp.Worker),
		slog.String("holder", d.Holder),
		slog.Uint64("suppressed", suppressed),
		slog.Any("error", d.Err),
	)
}

// maxDropStates bounds the fences a Reporter counts drops for one by one.
const maxDropStates = 1 << 17

// overflowFence counts the drops of fences beyond maxDropStates.
var overflowFence = leasehold.FenceID{Scope: "(other)"}

// Dropped returns how many effects of fence id were dropped.
func (r *Reporter) Dropped(id leasehold.FenceID) uint64 {
	r.mu.Lock()
	st := r.parts[id]
	r.mu.Unlock()
	if st == nil {
		return 0
	}
	return st.n.Load()
}

// Drops returns the drop count of every fence that dropped anything.
func (r *Reporter) Drops() map[leasehold.FenceID]uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[leasehold.FenceID]uint64, len(r.parts))
	for p, st := range r.parts {
		out[p] = st.n.Load()
	}
	return out
}

// reportSuspect counts a message set aside as suspicious in
// leasehold_sink_markers_suspicious_total{leasehold_sink, leasehold_reason},
// marks the span of ctx with the event leasehold.marker.suspicious, and
// logs it, at most once per reason per LogEvery.
func (r *Reporter) reportSuspect(ctx context.Context, d Decision) {
	reason := telemetry.AttrReason.String(d.Suspect)
	r.suspicious.Add(ctx, 1, metric.WithAttributes(telemetry.AttrSink.String(r.name), reason))
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(reason)
		span.AddEvent("leasehold.marker.suspicious", trace.WithAttributes(reason, telemetry.AttrPosition.Int64(int64(d.Position))))
	}
	r.mu.Lock()
	st := r.suspects[d.Suspect]
	if st == nil {
		st = &dropState{}
		r.suspects[d.Suspect] = st
	}
	now := r.now()
	if !st.lastLog.IsZero() && now.Sub(st.lastLog) < r.logEvery {
		st.suppressed++
		r.mu.Unlock()
		return
	}
	suppressed := st.suppressed
	st.lastLog, st.suppressed = now, 0
	r.mu.Unlock()
	r.log.LogAttrs(ctx, slog.LevelWarn, "leasehold: suspicious message set aside",
		slog.String("sink", r.name),
		slog.String("reason", d.Suspect),
		slog.String("outcome", d.Outcome.String()),
		slog.String("scope", d.Stamp.Scope),
		slog.Uint64("partition", uint64(d.Stamp.Partition)),
		slog.Uint64("epoch", uint64(d.Stamp.Epoch)),
		slog.String("key", d.Stamp.Key),
		slog.String("worker", d.Stamp.Worker),
		slog.String("subject", d.Subject),
		slog.Uint64("position", d.Position),
		slog.Uint64("suppressed", suppressed),
		slog.Any("error", d.Err),
	)
}
