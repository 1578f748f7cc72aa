package sinktest

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"pgregory.net/rapid"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// callSpec is one call of a concurrent step: an Advance, or an Apply of
// one effect or (with atomic batches) several.
type callSpec struct {
	Lease   *leaseSpec
	Effects []effectSpec
}

func (c callSpec) GoString() string {
	if c.Lease != nil {
		return fmt.Sprintf("Advance(%#v)", *c.Lease)
	}
	return fmt.Sprintf("Apply(%s)", specList(c.Effects))
}

func callGen(atomic bool) *rapid.Generator[callSpec] {
	return rapid.Custom(func(t *rapid.T) callSpec {
		kinds := 2
		if atomic {
			kinds = 3
		}
		switch rapid.IntRange(0, kinds-1).Draw(t, "kind") {
		case 0:
			return callSpec{Effects: []effectSpec{effectGen.Draw(t, "effect")}}
		case 1:
			l := leaseGen.Draw(t, "lease")
			return callSpec{Lease: &l}
		}
		return callSpec{Effects: batchGen.Draw(t, "batch")}
	})
}

// call is a concurrent call with its real-time interval (ticks of a shared
// counter) and its result.
type call struct {
	spec       callSpec
	effects    []sink.Effect
	lease      leasehold.Lease
	start, end int64
	err        error
}

// readSnapshot is the applied effects one read saw, with its interval.
type readSnapshot struct {
	start, end int64
	applied    map[appliedID][]string
}

// maxSnapshots bounds the reads taken while the calls run: against a fast
// sink the calls end long before, against a slow one they are plenty.
const maxSnapshots = 64

// concurrent makes two or three calls at once while a reader takes
// snapshots of the applied effects, and requires that some order of the
// calls, consistent with their real-time order, explains every call's
// result, every snapshot (each at a point within its own interval) and the
// sink's state afterwards: the sink is linearizable, with the model as its
// sequential specification. A sink that checks its fence and writes in two
// steps lets a snapshot see a newer epoch's effect and then, later, an
// older one's; a sink whose batches deadlock returns an error no order
// explains.
func (m *machine) concurrent(rt *rapid.T) {
	n := rapid.IntRange(2, 3).Draw(rt, "calls")
	gen := callGen(m.f.AtomicBatch)
	calls := make([]*call, n)
	for i := range calls {
		calls[i] = &call{spec: gen.Draw(rt, fmt.Sprintf("call %d", i+1))}
	}
	m.step++
	for _, c := range calls {
		if c.spec.Lease != nil {
			c.lease = m.lease(*c.spec.Lease)
			continue
		}
		for _, e := range c.spec.Effects {
			c.effects = append(c.effects, m.effect(e))
		}
	}

	var clock atomic.Int64
	begin := make(chan struct{})
	var wg sync.WaitGroup
	for _, c := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-begin
			c.start = clock.Add(1)
			if c.spec.Lease != nil {
				c.err = m.s.Advance(m.ctx, c.lease)
			} else {
				c.err = m.s.Apply(m.ctx, c.effects...)
			}
			c.end = clock.Add(1)
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var snaps []readSnapshot
	var readErr error
	read := func() bool {
		s := readSnapshot{start: clock.Add(1)}
		s.applied, readErr = m.readApplied()
		s.end = clock.Add(1)
		snaps = append(snaps, s)
		return readErr == nil
	}
	close(begin)
	for readErr == nil {
		select {
		case <-done:
		default:
			if len(snaps) < maxSnapshots && read() {
				continue
			}
			<-done
		}
		break
	}
	<-done

	var desc []string
	var history []string
	logf := func(format string, args ...any) {
		history = append(history, fmt.Sprintf(format, args...))
		rt.Logf(format, args...)
	}
	logf("step %d: before: fences %s; applied %s", m.step, m.describeFences(m.model.fences), m.describeApplied(m.model.applied))
	for _, c := range calls {
		desc = append(desc, c.spec.GoString())
		logf("step %d: concurrent %#v = %v [%d, %d]", m.step, c.spec, c.err, c.start, c.end)
	}
	logf("step %d: %d snapshots taken while the calls ran", m.step, len(snaps))
	if readErr != nil {
		rt.Logf("step %d: reading the sink: %v", m.step, readErr)
		rt.Fatalf("step %d: reading the sink's applied effects failed", m.step)
	}
	final, err := m.read()
	if err != nil {
		rt.Logf("step %d: reading the sink: %v", m.step, err)
		rt.Fatalf("step %d: reading the sink's fences or applied effects failed", m.step)
	}
	if next := m.linearize(logf, calls, snaps, final); next != nil {
		m.model = next
		return
	}
	for i, s := range snaps {
		logf("step %d: snapshot %d [%d, %d]: %s", m.step, i+1, s.start, s.end, m.describeApplied(s.applied))
	}
	logf("step %d: afterwards: fences %s; applied %s", m.step, m.describeFences(final.fences), m.describeApplied(final.applied))
	if m.original != nil {
		m.original(strings.Join(history, "\n"))
	}
	rt.Fatalf("step %d: no order of the concurrent calls %s explains their results, what the reader saw while they ran and the state after",
		m.step, strings.Join(desc, " | "))
}

// linearize returns the model after the calls in the first order that
// explains what was seen, or nil.
func (m *machine) linearize(logf func(string, ...any), calls []*call, snaps []readSnapshot, final state) *model {
	for _, order := range permutations(len(calls)) {
		if next, why := m.explain(calls, order, snaps, final); why != "" {
			logf("step %d: order %v: %s", m.step, order, why)
		} else {
			return next
		}
	}
	return nil
}

// explain runs the calls on a copy of the model in order and says why that
// does not explain what was seen, or "".
func (m *machine) explain(calls []*call, order []int, snaps []readSnapshot, final state) (*model, string) {
	pos := make([]int, len(calls))
	for p, i := range order {
		pos[i] = p
	}
	for _, a := range calls {
		for bi, b := range calls {
			if a.end < b.start && pos[bi] < pos[indexOf(calls, a)] {
				return nil, "breaks the calls' real-time order"
			}
		}
	}
	mod := m.model.clone()
	after := []*model{mod.clone()} // after[j]: the model after the first j calls
	for _, i := range order {
		c := calls[i]
		var o outcome
		if c.spec.Lease != nil {
			o = mod.advance(c.lease)
		} else {
			o = mod.apply(c.effects)
		}
		if why := o.mismatch(c.err); why != "" {
			return nil, fmt.Sprintf("%#v %s", c.spec, why)
		}
		after = append(after, mod.clone())
	}
	// Each snapshot sees the state after some prefix of the order: one that
	// holds every call that ended before the snapshot started and none that
	// started after it ended, and no shorter than an earlier snapshot's.
	// It may also see part of the next call's effects: a batch is all or
	// none, but the contract does not say readers see it land at once (a
	// JetStream batch is stored message by message).
	j := 0
	for si, s := range snaps {
		lo, hi := 0, len(order)
		for p, i := range order {
			if calls[i].end < s.start {
				lo = max(lo, p+1)
			}
			if calls[i].start > s.end {
				hi = min(hi, p)
			}
		}
		j = max(j, lo)
		for j <= hi && after[j].mismatchApplied(s.applied, m.appliedLabel) != "" &&
			(j == hi || !between(after[j].applied, s.applied, after[j+1].applied)) {
			j++
		}
		if j > hi {
			return nil, fmt.Sprintf("snapshot %d matches no state it could have seen", si+1)
		}
	}
	if why := mod.mismatchFences(final.fences, m.fenceLabel); why != "" {
		return nil, "afterwards " + why
	}
	if why := mod.mismatchApplied(final.applied, m.appliedLabel); why != "" {
		return nil, "afterwards " + why
	}
	return mod, ""
}

func (m *machine) describeApplied(applied map[appliedID][]string) string {
	var parts []string
	for _, id := range slices.SortedFunc(maps.Keys(applied), compareApplied) {
		parts = append(parts, fmt.Sprintf("%s=%q", m.appliedLabel(id), applied[id]))
	}
	return strings.Join(parts, " ")
}

func (m *machine) describeFences(fences map[leasehold.FenceID]leasehold.FenceState) string {
	var parts []string
	for _, id := range slices.SortedFunc(maps.Keys(fences), compareFence) {
		if f := fences[id]; f.Epoch != 0 || f.Acquisition != "" {
			parts = append(parts, fmt.Sprintf("%s=e%d of %q", m.fenceLabel(id), f.Epoch, f.Acquisition))
		}
	}
	return strings.Join(parts, " ")
}

// between reports whether applied holds everything of from and nothing
// that to does not.
func between(from, applied, to map[appliedID][]string) bool {
	return contains(applied, from) && contains(to, applied)
}

// contains reports whether every application in b is in a.
func contains(a, b map[appliedID][]string) bool {
	for id, ds := range b {
		for _, d := range ds {
			if !slices.Contains(a[id], d) {
				return false
			}
		}
	}
	return true
}

func indexOf(calls []*call, c *call) int {
	for i, x := range calls {
		if x == c {
			return i
		}
	}
	return -1
}

// permutations returns every order of 0..n-1.
func permutations(n int) [][]int {
	if n == 0 {
		return [][]int{{}}
	}
	var out [][]int
	for _, p := range permutations(n - 1) {
		for i := 0; i <= len(p); i++ {
			q := append(append(append([]int{}, p[:i]...), n-1), p[i:]...)
			out = append(out, q)
		}
	}
	return out
}
