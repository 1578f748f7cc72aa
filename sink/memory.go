package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// MemoryConfig configures a Memory sink.
type MemoryConfig struct {
	// Name names the sink in decisions and logs. Default "memory".
	Name string
	// NoDedupe turns idempotency-key dedupe off. With dedupe on (the
	// default) the sink remembers every key it applied, for its lifetime.
	NoDedupe bool
	// KeepLog keeps every applied effect, in order, for Applied. Default
	// off: only the latest effect per subject is kept.
	KeepLog bool
	// Verifier, when set, turns on verified epochs (see EpochCheck).
	Verifier Verifier
	// Observer receives every decision. Optional.
	Observer Observer
	// Logger receives rate-limited drop lines. Default slog.Default().
	Logger *slog.Logger
	// Telemetry selects the providers of the sink's spans and metrics (see
	// Reporter). Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

// Memory is the reference sink: it keeps the fences and the applied
// effects in memory, behind one mutex, so check and write are one critical
// section. Batches are all-or-nothing. It is not durable.
type Memory struct {
	rep    *Reporter
	check  *EpochCheck
	dedupe bool
	keep   bool

	mu     sync.Mutex
	fences map[leasehold.FenceID]leasehold.FenceState
	keys   map[dedupeID]struct{}
	data   map[string]Effect
	log    []Effect
}

// dedupeID is an idempotency key within its scope: scopes never share
// dedupe records.
type dedupeID struct{ scope, key string }

var _ Sink = (*Memory)(nil)

// NewMemory returns an empty Memory sink.
func NewMemory(cfg MemoryConfig) *Memory {
	if cfg.Name == "" {
		cfg.Name = "memory"
	}
	return &Memory{
		rep:    NewReporter(ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check:  NewEpochCheck(cfg.Verifier),
		dedupe: !cfg.NoDedupe,
		keep:   cfg.KeepLog,
		fences: make(map[leasehold.FenceID]leasehold.FenceState),
		keys:   make(map[dedupeID]struct{}),
		data:   make(map[string]Effect),
	}
}

// Apply applies the effects if every one is admitted, and none otherwise.
func (m *Memory) Apply(ctx context.Context, effects ...Effect) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("sink: apply: %w", err)
	}
	ctx, span := m.rep.StartApply(ctx, effects)
	defer span.End()
	if i, err := ValidateEffects(effects); err != nil {
		if i >= 0 {
			m.rep.Report(ctx, Decision{Outcome: BadStamp, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
		}
		return err
	}
	if m.check != nil {
		if err := m.verify(ctx, effects); err != nil {
			return err
		}
	}
	if len(effects) == 1 {
		return m.applyOne(ctx, &effects[0])
	}
	return m.applyBatch(ctx, effects)
}

// applyOne is the common case, kept free of allocations.
func (m *Memory) applyOne(ctx context.Context, e *Effect) error {
	s := e.Stamp
	id := s.Fence()
	m.mu.Lock()
	f := m.fences[id]
	v, raise := leasehold.Judge(f, s)
	if v != leasehold.Admit {
		m.mu.Unlock()
		return m.refused(ctx, e, f, v)
	}
	if raise || (s.Worker != "" && s.Worker != f.Holder) {
		m.fences[id] = leasehold.FenceState{Epoch: s.Epoch, Acquisition: s.Acquisition, Holder: s.Worker}
	}
	outcome := m.dedupeOne(s)
	if outcome == Accepted {
		m.write(e)
	}
	m.mu.Unlock()
	m.rep.Report(ctx, Decision{Outcome: outcome, Stamp: s, Subject: e.Subject, Max: s.Epoch})
	return nil
}

// refused reports and returns the refusal of e by fence f.
func (m *Memory) refused(ctx context.Context, e *Effect, f leasehold.FenceState, v leasehold.Verdict) error {
	err := leasehold.Refusal(f, e.Stamp, v)
	m.rep.Report(ctx, Decision{Outcome: Refused(v), Stamp: e.Stamp, Subject: e.Subject, Max: f.Epoch, MaxAcquisition: f.Acquisition, Holder: f.Holder, Err: err})
	return err
}

func (m *Memory) applyBatch(ctx context.Context, effects []Effect) error {
	decisions := make([]Decision, len(effects))
	m.mu.Lock()
	// First pass: judge every effect against the fences as the batch would
	// leave them, without changing anything. A batch's fences are few: a
	// look at each, in room on the stack, where a map cost two
	// allocations a batch.
	var room [8]runningFence
	running := room[:0]
	for i := range effects {
		s := effects[i].Stamp
		id := s.Fence()
		at := slices.IndexFunc(running, func(r runningFence) bool { return r.id == id })
		if at < 0 {
			running = append(running, runningFence{id, m.fences[id]})
			at = len(running) - 1
		}
		f := running[at].f
		v, raise := leasehold.Judge(f, s)
		if v != leasehold.Admit {
			m.mu.Unlock()
			err := m.refused(ctx, &effects[i], f, v)
			return fmt.Errorf("sink: effect %d of %d: %w (no effect of the batch was applied)", i+1, len(effects), err)
		}
		if raise || (s.Worker != "" && s.Worker != f.Holder) {
			f = leasehold.FenceState{Epoch: s.Epoch, Acquisition: s.Acquisition, Holder: s.Worker}
		}
		running[at].f = f
	}
	for _, r := range running {
		m.fences[r.id] = r.f
	}
	for i := range effects {
		e := &effects[i]
		s := e.Stamp
		// A key met earlier in the batch is in keys already: its repeat
		// is a duplicate, as in separate calls.
		outcome := m.dedupeOne(s)
		if outcome == Accepted {
			m.write(e)
		}
		decisions[i] = Decision{Outcome: outcome, Stamp: s, Subject: e.Subject, Max: s.Epoch}
	}
	m.mu.Unlock()
	for _, d := range decisions {
		m.rep.Report(ctx, d)
	}
	return nil
}

// runningFence is a fence as the batch being judged leaves it.
type runningFence struct {
	id leasehold.FenceID
	f  leasehold.FenceState
}

// dedupeOne records s's key as applied and returns Accepted, or
// Duplicate when it was already; m.mu is held. One map write does both:
// a look-up before the write hashed each key twice.
func (m *Memory) dedupeOne(s leasehold.Stamp) Outcome {
	if !m.dedupe {
		return Accepted
	}
	n := len(m.keys)
	m.keys[dedupeID{s.Scope, s.Key}] = struct{}{}
	if len(m.keys) == n {
		return Duplicate
	}
	return Accepted
}

func (m *Memory) write(e *Effect) {
	m.data[e.Subject] = *e
	if m.keep {
		m.log = append(m.log, *e)
	}
}

// verify checks, outside the lock, every stamp that would raise its
// fence. The lock is not held across the lease bucket's answer; a fence
// that rises meanwhile only makes the locked judgement stricter: what
// raises the risen fence raised the one read here too.
func (m *Memory) verify(ctx context.Context, effects []Effect) error {
	for i := range effects {
		s := effects[i].Stamp
		m.mu.Lock()
		f := m.fences[s.Fence()]
		m.mu.Unlock()
		if err := m.check.CheckRaise(ctx, s, f); err != nil {
			d := Decision{Outcome: Unverified, Stamp: s, Subject: effects[i].Subject, Max: f.Epoch, MaxAcquisition: f.Acquisition, Err: err}
			if !isUnverified(err) {
				d.Outcome = Failed
			}
			m.rep.Report(ctx, d)
			return err
		}
	}
	return nil
}

// Advance raises l's fence to l's epoch and acquisition. It returns a
// *leasehold.StaleEpochError when the fence is above l's epoch, or at it
// for another acquisition.
func (m *Memory) Advance(ctx context.Context, l leasehold.Lease) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("sink: advance: %w", err)
	}
	if err := ValidateAdvance(l); err != nil {
		return fmt.Errorf("sink: advance: %w", err)
	}
	s := AdvanceStamp(l)
	id := l.Fence()
	report := s
	report.Key = ""
	m.mu.Lock()
	cur := m.fences[id]
	m.mu.Unlock()
	if err := m.check.CheckRaise(ctx, s, cur); err != nil {
		if isUnverified(err) {
			m.rep.Report(ctx, Decision{Outcome: Unverified, Stamp: report, Max: cur.Epoch, MaxAcquisition: cur.Acquisition, Err: err})
		}
		return err
	}
	m.mu.Lock()
	f := m.fences[id]
	v, raise := leasehold.Judge(f, s)
	if v != leasehold.Admit {
		m.mu.Unlock()
		err := leasehold.Refusal(f, s, v)
		m.rep.Report(ctx, Decision{Outcome: Refused(v), Stamp: report, Max: f.Epoch, MaxAcquisition: f.Acquisition, Holder: f.Holder, Err: err})
		return fmt.Errorf("sink: advance: %w", err)
	}
	if raise {
		m.fences[id] = leasehold.FenceState{Epoch: l.Epoch, Acquisition: l.Acquisition, Holder: l.Holder}
	}
	m.mu.Unlock()
	if raise {
		m.rep.Report(ctx, Decision{Outcome: Advanced, Stamp: report, Max: l.Epoch})
	}
	return nil
}

// Fence returns what the sink records for id.
func (m *Memory) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	if err := ctx.Err(); err != nil {
		return leasehold.FenceState{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.fences[id], nil
}

// Dropped returns how many effects of fence id were refused.
func (m *Memory) Dropped(id leasehold.FenceID) uint64 { return m.rep.Dropped(id) }

// Get returns the latest effect applied to subject.
func (m *Memory) Get(subject string) (Effect, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.data[subject]
	return e, ok
}

// Applied returns every applied effect in the order applied, when the sink
// keeps a log (MemoryConfig.KeepLog), and the latest effect per subject
// otherwise.
func (m *Memory) Applied() []Effect {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.keep {
		return append([]Effect(nil), m.log...)
	}
	out := make([]Effect, 0, len(m.data))
	for _, e := range m.data {
		out = append(out, e)
	}
	return out
}

func isUnverified(err error) bool { return errors.Is(err, ErrUnverifiedEpoch) }
