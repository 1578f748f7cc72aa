package sinktest

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// DefaultPropertyRuns is how many random sequences each of the property
// test's two searches runs against a sink unless Features.PropertyRuns or
// the environment says otherwise. Each sequence builds a sink, so the count
// is what bounds the test's cost: with the race detector on a 2-core
// machine, 15 and 15 take about 0.5 s against the memory sink, 10 s against
// kvsink and PostgreSQL, 15 s against the stream sink.
const DefaultPropertyRuns = 15

// PropertyRunsEnv names the environment variable that, when set to a
// positive number, overrides Features.PropertyRuns for every sink: raise it
// for a long search, lower it on a slow machine. rapid's own -rapid.checks
// caps it (100 by default, 20 with -short), and -rapid.steps sets the
// average length of a sequence (30).
const PropertyRunsEnv = "LEASEHOLD_SINKTEST_RUNS"

// RunProperties runs the property test alone: random sequences of Advance,
// Apply of one effect, Apply of a batch, concurrent calls, reopen and crash
// (where the Instance supports them) and full checks, over two scopes, two
// partitions, epochs 1 to 6 from two acquisitions each, and four
// idempotency keys, compared after every call with a reference model of the
// fence contract (leasehold.Judge per fence; dedupe by scope and key when
// the sink dedupes; all-or-none batches when it has them). A failing
// sequence is shrunk by rapid to a minimal one, which the failure shows
// step by step. Run includes it as the case Properties.
func RunProperties(t *testing.T, features Features, newSink Constructor) {
	t.Helper()
	features.setDefaults()
	h := &harness{t: t, f: features, rec: &recorder{}, newSink: newSink}
	testProperties(t, h)
}

func propertyRuns(f Features) int {
	if v, ok := os.LookupEnv(PropertyRunsEnv); ok {
		if n, err := strconv.Atoi(v); err == nil && n > 0 {
			return n
		}
	}
	if f.PropertyRuns > 0 {
		return f.PropertyRuns
	}
	return DefaultPropertyRuns
}

// testProperties runs two searches. Sequential makes one call at a time,
// so a failure replays exactly and rapid shrinks it; Concurrent adds steps
// of concurrent calls, whose failures depend on the interleaving and may not
// replay: the first failing run then logs its own history (each call's
// result and interval, every snapshot, the state after and why each order
// fails), since rapid shows only the replay's. A defect that does not need
// a race is found by the first.
func testProperties(t *testing.T, h *harness) {
	budget := propertyRuns(h.f)
	t.Run("Sequential", func(t *testing.T) {
		if h.f.Parallel {
			t.Parallel()
		}
		search(t, h, budget, false)
	})
	t.Run("Concurrent", func(t *testing.T) {
		if h.f.Parallel {
			t.Parallel()
		}
		if h.f.SkipConcurrent != "" {
			t.Skip("sinktest: the concurrent search is skipped: " + h.f.SkipConcurrent)
		}
		search(t, h, budget, true)
	})
}

// search has rapid draw the sequences. rapid runs a property -rapid.checks
// times; runs past the budget return at once without building a sink,
// except once a run has failed: reproducing and shrinking the failure
// replays it many times.
func search(t *testing.T, h *harness, budget int, concurrent bool) {
	runs, failed := 0, false
	rapid.Check(t, func(rt *rapid.T) {
		if runs >= budget && !failed {
			return
		}
		runs++
		// The first failing run's history goes to t: a concurrent failure
		// may not replay, and rapid then shows only a passing replay.
		var original func(string)
		if !failed {
			original = func(history string) { t.Logf("sinktest: the failing run, as it ran:\n%s", history) }
		}
		returned := false
		defer func() { failed = failed || !returned || rt.Failed() }()
		runMachine(t, rt, h, concurrent, original)
		returned = true
	})
	t.Logf("sinktest: %d random sequences run against the sink (budget %d; set %s to change it)", runs, budget, PropertyRunsEnv)
}

// runMachine runs one sequence against a fresh sink. The sink is built in
// a subtest of its own, which stays open until the sequence ends, so that
// its t.Cleanup runs after each sequence rather than after all of them;
// the sequence itself runs on rapid's goroutine, so that rapid sees each
// failure where it happened.
func runMachine(t *testing.T, rt *rapid.T, h *harness, concurrent bool, original func(string)) {
	type built struct {
		inst Instance
		name string
	}
	got := make(chan built, 1)
	release := make(chan struct{})
	ended := make(chan bool, 1)
	go func() {
		ended <- t.Run("run", func(st *testing.T) {
			name := newName(st.Name())
			inst := h.newSink(st, Setup{Name: name, Observer: &recorder{}})
			if inst.Sink == nil || inst.Applied == nil {
				st.Fatal("sinktest: the constructor must set Instance.Sink and Instance.Applied")
			}
			if h.f.Durable && inst.Reopen == nil {
				st.Fatal("sinktest: Features.Durable needs Instance.Reopen")
			}
			got <- built{inst, name}
			<-release
		})
	}()
	var b built
	select {
	case b = <-got:
	case <-ended:
		t.FailNow() // the subtest says why
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer func() {
		cancel()
		close(release)
		<-ended
	}()
	if b.inst.Subject == nil {
		b.inst.Subject = func(n string) string { return n }
	}
	m := &machine{ctx: ctx, f: h.f, inst: b.inst, s: b.inst.Sink, name: b.name, model: newModel(h.f), original: original}
	m.scopes = [2]string{"jobs-" + b.name, "jobs-" + b.name + "-b"}
	actions := map[string]func(*rapid.T){
		"advance":    m.advance,
		"apply":      m.applyOne,
		"applyBatch": m.applyBatch,
		"check":      m.check,
	}
	if concurrent {
		actions["concurrent"] = m.concurrent
	}
	if h.f.Durable {
		actions["reopen"] = m.reopen
	}
	if b.inst.Crash != nil {
		actions["crash"] = m.crash
	}
	rt.Repeat(actions)
	m.check(rt)
}

// machine is one sequence's sink and the model it is held to.
type machine struct {
	ctx    context.Context
	f      Features
	inst   Instance
	s      sink.Sink
	name   string
	scopes [2]string
	model  *model
	step   int
	// original, when set, receives the history of a concurrent step no
	// order explains, in the run that failed first (not a replay).
	original func(string)
}

// effectSpec is a drawn effect; its fields index the sequence's scopes,
// partitions, epochs, acquisitions of an epoch and keys.
type effectSpec struct{ Scope, Partition, Epoch, Acq, Key int }

func (e effectSpec) GoString() string {
	return fmt.Sprintf("%s e%d%s k%d", fenceLabel(e.Scope, e.Partition), e.Epoch, acqLabel(e.Acq), e.Key)
}

// leaseSpec is a drawn lease for Advance.
type leaseSpec struct{ Scope, Partition, Epoch, Acq int }

func (l leaseSpec) GoString() string {
	return fmt.Sprintf("%s e%d%s", fenceLabel(l.Scope, l.Partition), l.Epoch, acqLabel(l.Acq))
}

func fenceLabel(scope, p int) string { return fmt.Sprintf("%c/p%d", 'a'+scope, p) }

// acqLabel marks the second acquisition of an epoch: the split-brain twin.
func acqLabel(a int) string { return strings.Repeat("'", a) }

var (
	effectGen = rapid.Custom(func(t *rapid.T) effectSpec {
		return effectSpec{
			Scope:     rapid.IntRange(0, 1).Draw(t, "scope"),
			Partition: rapid.IntRange(0, 1).Draw(t, "partition"),
			Epoch:     rapid.IntRange(1, 6).Draw(t, "epoch"),
			Acq:       rapid.IntRange(0, 1).Draw(t, "acquisition"),
			Key:       rapid.IntRange(0, 3).Draw(t, "key"),
		}
	})
	leaseGen = rapid.Custom(func(t *rapid.T) leaseSpec {
		return leaseSpec{
			Scope:     rapid.IntRange(0, 1).Draw(t, "scope"),
			Partition: rapid.IntRange(0, 1).Draw(t, "partition"),
			Epoch:     rapid.IntRange(1, 6).Draw(t, "epoch"),
			Acq:       rapid.IntRange(0, 1).Draw(t, "acquisition"),
		}
	})
	batchGen = rapid.SliceOfN(effectGen, 2, 4)
)

// rapid names a generator the first time its name is asked for, behind a
// sync.Once, but a draw reads the name without one: the race detector
// caught a draw of effectGen against batchGen naming it, in two searches
// running at once. Named here, before any test runs, the shared
// generators are only read.
func init() {
	for _, g := range []fmt.Stringer{effectGen, leaseGen, batchGen} {
		_ = g.String()
	}
}

func acquisition(e leasehold.Epoch, a int) string {
	if a == 0 {
		return acq(e)
	}
	return acq(e) + "-twin"
}

// effect is the effect spec e stands for, written at the current step: its
// data names the step, so the model can tell which application a sink
// kept.
func (m *machine) effect(e effectSpec) sink.Effect {
	name := fmt.Sprintf("k%d", e.Key)
	subject := name
	if e.Scope == 1 {
		subject += "-b"
	}
	ep := leasehold.Epoch(e.Epoch)
	a := acquisition(ep, e.Acq)
	return sink.Effect{
		Stamp: leasehold.Stamp{Scope: m.scopes[e.Scope], Partition: leasehold.Partition(e.Partition), Epoch: ep,
			Acquisition: a, Key: m.name + "." + name, Worker: "w-" + a},
		Subject: m.inst.Subject(subject),
		Data:    fmt.Appendf(nil, "step %d: %#v", m.step, e),
	}
}

func (m *machine) lease(l leaseSpec) leasehold.Lease {
	ep := leasehold.Epoch(l.Epoch)
	a := acquisition(ep, l.Acq)
	return leasehold.Lease{Scope: m.scopes[l.Scope], Partition: leasehold.Partition(l.Partition), Epoch: ep, Acquisition: a, Holder: "w-" + a}
}

func (m *machine) advance(rt *rapid.T) {
	spec := leaseGen.Draw(rt, "lease")
	m.step++
	l := m.lease(spec)
	want := m.model.advance(l)
	err := m.s.Advance(m.ctx, l)
	m.judge(rt, fmt.Sprintf("Advance(%#v)", spec), want, err)
}

func (m *machine) applyOne(rt *rapid.T) {
	spec := effectGen.Draw(rt, "effect")
	m.step++
	m.applySpecs(rt, []effectSpec{spec})
}

func (m *machine) applyBatch(rt *rapid.T) {
	specs := batchGen.Draw(rt, "batch")
	m.step++
	m.applySpecs(rt, specs)
}

func (m *machine) applySpecs(rt *rapid.T, specs []effectSpec) {
	es := make([]sink.Effect, len(specs))
	for i, s := range specs {
		es[i] = m.effect(s)
	}
	want := m.model.apply(es)
	err := m.s.Apply(m.ctx, es...)
	m.judge(rt, fmt.Sprintf("Apply(%s)", specList(specs)), want, err)
}

func specList(specs []effectSpec) string {
	parts := make([]string, len(specs))
	for i, s := range specs {
		parts[i] = s.GoString()
	}
	return strings.Join(parts, ", ")
}

// judge fails the sequence if err is not what the model expects.
func (m *machine) judge(rt *rapid.T, call string, want outcome, err error) {
	rt.Logf("step %d: %s = %v (model: %s)", m.step, call, err, want)
	if msg := want.mismatch(err); msg != "" {
		rt.Fatalf("step %d: %s %s", m.step, call, msg)
	}
}

func (m *machine) reopen(rt *rapid.T) {
	m.step++
	s, err := m.inst.Reopen(m.ctx)
	m.reopened(rt, "reopen", s, err)
}

func (m *machine) crash(rt *rapid.T) {
	m.step++
	s, err := m.inst.Crash(m.ctx)
	m.reopened(rt, "crash", s, err)
}

func (m *machine) reopened(rt *rapid.T, what string, s sink.Sink, err error) {
	rt.Logf("step %d: %s = %v", m.step, what, err)
	if err != nil || s == nil {
		rt.Fatalf("step %d: %s failed", m.step, what)
	}
	m.s, m.inst.Sink = s, s
	m.check(rt)
}

// check compares every fence the sequence can touch, and the applied
// effects, with the model.
func (m *machine) check(rt *rapid.T) {
	st, err := m.read()
	if err != nil {
		rt.Logf("step %d: reading the sink: %v", m.step, err)
		rt.Fatalf("step %d: reading the sink's fences or applied effects failed", m.step)
	}
	if msg := m.model.mismatchFences(st.fences, m.fenceLabel); msg != "" {
		rt.Fatalf("step %d: %s", m.step, msg)
	}
	if msg := m.model.mismatchApplied(st.applied, m.appliedLabel); msg != "" {
		rt.Fatalf("step %d: %s", m.step, msg)
	}
}

// read returns what the sink shows of the sequence's fences and effects.
func (m *machine) read() (state, error) {
	st := state{fences: map[leasehold.FenceID]leasehold.FenceState{}}
	for _, scope := range m.scopes {
		for p := range leasehold.Partition(2) {
			id := leasehold.FenceID{Scope: scope, Partition: p}
			f, err := m.s.Fence(m.ctx, id)
			if err != nil {
				return state{}, fmt.Errorf("Fence(%s): %w", id, err)
			}
			st.fences[id] = f
		}
	}
	var err error
	st.applied, err = m.readApplied()
	return st, err
}

// readApplied returns the data of the sequence's applied effects by scope
// and key. Effects the sequence did not write (a log sink's barriers) are
// not its business.
func (m *machine) readApplied() (map[appliedID][]string, error) {
	es, err := m.inst.Applied(m.ctx)
	if err != nil {
		return nil, fmt.Errorf("Applied: %w", err)
	}
	out := map[appliedID][]string{}
	for _, e := range es {
		if !strings.HasPrefix(e.Stamp.Key, m.name+".k") {
			continue
		}
		id := idOf(e)
		out[id] = append(out[id], string(e.Data))
	}
	return out, nil
}

func (m *machine) scopeIndex(scope string) int {
	for i, s := range m.scopes {
		if s == scope {
			return i
		}
	}
	return -1
}

func (m *machine) fenceLabel(id leasehold.FenceID) string {
	return fenceLabel(m.scopeIndex(id.Scope), int(id.Partition))
}

func (m *machine) appliedLabel(id appliedID) string {
	i := m.scopeIndex(id.scope)
	if i < 0 {
		return "an effect of another scope"
	}
	return fmt.Sprintf("%c.%s", 'a'+i, strings.TrimPrefix(id.key, m.name+"."))
}
