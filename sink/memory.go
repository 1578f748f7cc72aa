package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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

// Memory is the reference sink: it keeps the maxima and the applied
// effects in memory, behind one mutex, so check and write are one critical
// section. Batches are all-or-nothing. It is not durable.
type Memory struct {
	rep    *Reporter
	check  *EpochCheck
	dedupe bool
	keep   bool

	mu    sync.Mutex
	parts map[leasehold.Partition]memPart
	keys  map[string]struct{}
	data  map[string]Effect
	log   []Effect
}

type memPart struct {
	max    leasehold.Epoch
	holder string
}

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
		parts:  make(map[leasehold.Partition]memPart),
		keys:   make(map[string]struct{}),
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
	m.mu.Lock()
	part := m.parts[s.Partition]
	if s.Epoch < part.max {
		m.mu.Unlock()
		err := StaleError(s, part.max, part.holder)
		m.rep.Report(ctx, Decision{Outcome: Stale, Stamp: s, Subject: e.Subject, Max: part.max, Holder: part.holder, Err: err})
		return err
	}
	if s.Epoch > part.max || s.Worker != "" {
		m.parts[s.Partition] = memPart{max: s.Epoch, holder: s.Worker}
	}
	outcome := Accepted
	if m.dedupe {
		if _, dup := m.keys[s.Key]; dup {
			outcome = Duplicate
		} else {
			m.keys[s.Key] = struct{}{}
		}
	}
	if outcome == Accepted {
		m.write(e)
	}
	m.mu.Unlock()
	m.rep.Report(ctx, Decision{Outcome: outcome, Stamp: s, Subject: e.Subject, Max: s.Epoch})
	return nil
}

func (m *Memory) applyBatch(ctx context.Context, effects []Effect) error {
	decisions := make([]Decision, len(effects))
	m.mu.Lock()
	// First pass: judge every effect against the maxima as the batch would
	// leave them, without changing anything.
	running := make(map[leasehold.Partition]leasehold.Epoch, 1)
	for i := range effects {
		s := effects[i].Stamp
		max, ok := running[s.Partition]
		if !ok {
			max = m.parts[s.Partition].max
		}
		if s.Epoch < max {
			holder := m.parts[s.Partition].holder
			m.mu.Unlock()
			err := StaleError(s, max, holder)
			m.rep.Report(ctx, Decision{Outcome: Stale, Stamp: s, Subject: effects[i].Subject, Max: max, Holder: holder, Err: err})
			return fmt.Errorf("sink: effect %d of %d: %w (no effect of the batch was applied)", i+1, len(effects), err)
		}
		running[s.Partition] = s.Epoch
	}
	seen := make(map[string]struct{}, len(effects))
	for i := range effects {
		e := &effects[i]
		s := e.Stamp
		if part := m.parts[s.Partition]; s.Epoch > part.max || s.Worker != "" {
			m.parts[s.Partition] = memPart{max: s.Epoch, holder: s.Worker}
		}
		outcome := Accepted
		if m.dedupe {
			_, dup := m.keys[s.Key]
			_, dupInBatch := seen[s.Key]
			if dup || dupInBatch {
				outcome = Duplicate
			} else {
				m.keys[s.Key] = struct{}{}
			}
		}
		seen[s.Key] = struct{}{}
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

func (m *Memory) write(e *Effect) {
	m.data[e.Subject] = *e
	if m.keep {
		m.log = append(m.log, *e)
	}
}

// verify checks, outside the lock, every epoch that would raise a maximum.
// The lock is not held across the lease bucket's answer; a maximum that
// rises meanwhile only makes the locked check stricter.
func (m *Memory) verify(ctx context.Context, effects []Effect) error {
	for i := range effects {
		s := effects[i].Stamp
		m.mu.Lock()
		max := m.parts[s.Partition].max
		m.mu.Unlock()
		if err := m.check.CheckAbove(ctx, s, max); err != nil {
			d := Decision{Outcome: Unverified, Stamp: s, Subject: effects[i].Subject, Max: max, Err: err}
			if !isUnverified(err) {
				d.Outcome = Failed
			}
			m.rep.Report(ctx, d)
			return err
		}
	}
	return nil
}

// Advance raises partition p's maximum to e if it is lower.
func (m *Memory) Advance(ctx context.Context, p leasehold.Partition, e leasehold.Epoch) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("sink: advance: %w", err)
	}
	if err := ValidateAdvance(p, e); err != nil {
		return fmt.Errorf("sink: advance: %w", err)
	}
	s := leasehold.Stamp{Partition: p, Epoch: e}
	m.mu.Lock()
	max := m.parts[p].max
	m.mu.Unlock()
	if err := m.check.CheckAbove(ctx, s, max); err != nil {
		if isUnverified(err) {
			m.rep.Report(ctx, Decision{Outcome: Unverified, Stamp: s, Max: max, Err: err})
		}
		return err
	}
	m.mu.Lock()
	raised := e > m.parts[p].max
	if raised {
		m.parts[p] = memPart{max: e, holder: HolderFrom(ctx)}
	}
	m.mu.Unlock()
	if raised {
		m.rep.Report(ctx, Decision{Outcome: Advanced, Stamp: s, Max: e})
	}
	return nil
}

// MaxEpoch returns partition p's recorded maximum, 0 if none.
func (m *Memory) MaxEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.parts[p].max, nil
}

// Dropped returns how many effects of partition p were refused.
func (m *Memory) Dropped(p leasehold.Partition) uint64 { return m.rep.Dropped(p) }

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
