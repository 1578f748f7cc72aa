package sinktest

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// model is the reference the property test holds a sink to: the fence
// contract of package sink, decided by leasehold.Judge and nothing else.
// Per fence it records the epoch and acquisition admitted last; per
// (scope, key) the data of every application.
type model struct {
	dedupe, atomic bool
	fences         map[leasehold.FenceID]leasehold.FenceState
	applied        map[appliedID][]string
}

func newModel(f Features) *model {
	return &model{dedupe: f.Dedupe, atomic: f.AtomicBatch, fences: map[leasehold.FenceID]leasehold.FenceState{}, applied: map[appliedID][]string{}}
}

func (m *model) clone() *model {
	c := *m
	c.fences = maps.Clone(m.fences)
	c.applied = make(map[appliedID][]string, len(m.applied))
	for id, ds := range m.applied {
		c.applied[id] = slices.Clone(ds)
	}
	return &c
}

// refusal is an effect (or an Advance) the model refuses, with the fence
// that refuses it.
type refusal struct {
	stamp   leasehold.Stamp
	fence   leasehold.FenceState
	verdict leasehold.Verdict
}

// outcome is what the model expects of one call: success, or a refusal by
// one of refused (a batch may hold several; the sink names any of them).
type outcome struct {
	advance bool
	refused []refusal
}

func (o outcome) String() string {
	if len(o.refused) == 0 {
		return "ok"
	}
	var parts []string
	for _, r := range o.refused {
		if r.verdict == leasehold.SplitBrain {
			parts = append(parts, fmt.Sprintf("split brain (e%d of %s, recorded for %s)", r.stamp.Epoch, r.stamp.Acquisition, r.fence.Acquisition))
		} else {
			parts = append(parts, fmt.Sprintf("stale (e%d below the recorded e%d)", r.stamp.Epoch, r.fence.Epoch))
		}
	}
	return "refused: " + strings.Join(parts, " or ")
}

// write applies an admitted effect to the model.
func (m *model) write(e sink.Effect) {
	id := idOf(e)
	if m.dedupe && len(m.applied[id]) > 0 {
		return
	}
	m.applied[id] = append(m.applied[id], string(e.Data))
}

// apply is Apply(effects...). An atomic batch judges each effect against
// the fences as the batch's earlier effects left them, and applies all or
// none; without atomic batches, Apply is Apply of each effect in turn,
// stopping at the first refused.
func (m *model) apply(effects []sink.Effect) outcome {
	if !m.atomic {
		for _, e := range effects {
			id := e.Stamp.Fence()
			f := m.fences[id]
			v, raise := leasehold.Judge(f, e.Stamp)
			if v != leasehold.Admit {
				return outcome{refused: []refusal{{e.Stamp, f, v}}}
			}
			if raise {
				m.fences[id] = leasehold.FenceState{Epoch: e.Stamp.Epoch, Acquisition: e.Stamp.Acquisition}
			}
			m.write(e)
		}
		return outcome{}
	}
	running := map[leasehold.FenceID]leasehold.FenceState{}
	var out outcome
	for _, e := range effects {
		id := e.Stamp.Fence()
		f, ok := running[id]
		if !ok {
			f = m.fences[id]
		}
		v, raise := leasehold.Judge(f, e.Stamp)
		switch {
		case v != leasehold.Admit:
			// Keep judging: a sink may judge the batch's fences in any
			// order, and so name the refusal of any of them.
			out.refused = append(out.refused, refusal{e.Stamp, f, v})
		case raise:
			f = leasehold.FenceState{Epoch: e.Stamp.Epoch, Acquisition: e.Stamp.Acquisition}
		}
		running[id] = f
	}
	if len(out.refused) > 0 {
		return out
	}
	maps.Copy(m.fences, running)
	for _, e := range effects {
		m.write(e)
	}
	return out
}

// advance is Advance(l): judged as an effect of l's stamp that applies
// nothing.
func (m *model) advance(l leasehold.Lease) outcome {
	st := sink.AdvanceStamp(l)
	f := m.fences[l.Fence()]
	v, raise := leasehold.Judge(f, st)
	if v != leasehold.Admit {
		return outcome{advance: true, refused: []refusal{{st, f, v}}}
	}
	if raise {
		m.fences[l.Fence()] = leasehold.FenceState{Epoch: l.Epoch, Acquisition: l.Acquisition}
	}
	return outcome{advance: true}
}

// mismatch says how err differs from what o expects, or "" if it does not.
// The message names no keys or resource names: it must be the same when
// rapid runs the sequence again on a freshly named sink.
func (o outcome) mismatch(err error) string {
	if len(o.refused) == 0 {
		if err != nil {
			return "returned an error, want success"
		}
		return ""
	}
	if err == nil {
		return "succeeded, want " + o.String()
	}
	se, ok := isStale(err)
	if !ok {
		return "returned an error that is not a *leasehold.StaleEpochError matching ErrStaleEpoch, want " + o.String()
	}
	for _, r := range o.refused {
		if se.Scope != r.stamp.Scope || se.Partition != r.stamp.Partition || se.Epoch != r.stamp.Epoch ||
			se.Acquisition != r.stamp.Acquisition || (!o.advance && se.Key != r.stamp.Key) {
			continue
		}
		split := r.verdict == leasehold.SplitBrain
		switch {
		case se.SplitBrain != split || errors.Is(err, leasehold.ErrSplitBrain) != split:
			return fmt.Sprintf("refused with SplitBrain %v, want %s", se.SplitBrain, o)
		case se.Max != r.fence.Epoch:
			return fmt.Sprintf("refused with max e%d, want %s", se.Max, o)
		case split && se.MaxAcquisition != r.fence.Acquisition:
			return fmt.Sprintf("refused naming the recorded acquisition %q, want %s", se.MaxAcquisition, o)
		}
		return ""
	}
	return "refused an effect the model does not refuse, want " + o.String()
}

// state is what a sink shows of itself: its fences and applied effects.
type state struct {
	fences  map[leasehold.FenceID]leasehold.FenceState
	applied map[appliedID][]string
}

// mismatchFences says how the fences differ from the model's, or "".
func (m *model) mismatchFences(got map[leasehold.FenceID]leasehold.FenceState, label func(leasehold.FenceID) string) string {
	for _, id := range slices.SortedFunc(maps.Keys(got), compareFence) {
		g, w := got[id], m.fences[id]
		if g.Epoch != w.Epoch || g.Acquisition != w.Acquisition {
			return fmt.Sprintf("fence %s is e%d of %q, want e%d of %q", label(id), g.Epoch, g.Acquisition, w.Epoch, w.Acquisition)
		}
	}
	return ""
}

// mismatchApplied says how the applied effects differ from the model's, or
// "". A deduping sink applies each key once, with the data of its first
// admitted effect; another applies it at least once and at most as often as
// it was admitted (a destination may keep one value per subject).
func (m *model) mismatchApplied(got map[appliedID][]string, label func(appliedID) string) string {
	for _, id := range slices.SortedFunc(maps.Keys(got), compareApplied) {
		if len(m.applied[id]) == 0 {
			return fmt.Sprintf("%s was applied %d times; it was never admitted", label(id), len(got[id]))
		}
	}
	for _, id := range slices.SortedFunc(maps.Keys(m.applied), compareApplied) {
		want, have := m.applied[id], got[id]
		switch {
		case m.dedupe && (len(have) != 1 || have[0] != want[0]):
			return fmt.Sprintf("%s applied as %q, want once as %q", label(id), have, want[0])
		case len(have) == 0 || len(have) > len(want):
			return fmt.Sprintf("%s applied %d times, want 1 to %d", label(id), len(have), len(want))
		}
		for _, d := range have {
			if !slices.Contains(want, d) {
				return fmt.Sprintf("%s applied with data %q, which no admitted effect of it carries", label(id), d)
			}
		}
	}
	return ""
}

func compareFence(a, b leasehold.FenceID) int {
	if c := strings.Compare(a.Scope, b.Scope); c != 0 {
		return c
	}
	return int(a.Partition) - int(b.Partition)
}

func compareApplied(a, b appliedID) int {
	if c := strings.Compare(a.scope, b.scope); c != 0 {
		return c
	}
	return strings.Compare(a.key, b.key)
}
