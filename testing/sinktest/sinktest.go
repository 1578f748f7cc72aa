// Package sinktest is the conformance suite every leasehold sink must pass.
//
// A sink package calls Run from a test with the Features it supports and a
// Constructor that builds a fresh sink for one case:
//
//	func TestConformance(t *testing.T) {
//		sinktest.Run(t, sinktest.Features{Durable: true, AtomicBatch: true, Dedupe: true, VerifiedEpochs: true},
//			func(t *testing.T, s sinktest.Setup) sinktest.Instance { ... })
//	}
//
// Every case gets a unique Setup.Name, to be used in every bucket, stream
// or table name the sink needs, so that cases never see each other's data.
// The cases are the fence contract of package sink: first epoch accepted,
// equal epochs accepted, stale effects refused with no effect, partitions
// independent, scopes independent (two job streams and a lock sharing the
// sink, the same partition number and idempotency key in each), split-brain
// writes (one epoch, two acquisitions) refused, Advance fencing before the
// new holder writes and refusing to go back, maxima that survive a reopen,
// all-or-nothing batches, many goroutines racing with mixed epochs, dedupe,
// cancelled contexts, bad stamps and headers, and forged epochs under
// verification against a real lease bucket: epochs never issued, epochs
// issued to another fence of the bucket, the holder's epoch with a forged
// acquisition (as an effect and as an Advance before the holder's own), a
// former holder far behind (admitted while the fence record remembers it,
// refused as forgotten after), and a fence record of the previous release's
// format. Last, the case Properties
// (also callable alone as RunProperties) runs random sequences of calls,
// some of them concurrent, against new sinks and compares every result with
// a reference model of the contract; rapid shrinks a failing sequence to a
// minimal one.
//
// Import it from tests only.
package sinktest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// Features says which cases apply to a sink.
type Features struct {
	// Durable: Instance.Reopen opens the sink again on the same storage,
	// and the maxima and applied effects survive.
	Durable bool
	// AtomicBatch: Apply with several effects applies all or none.
	AtomicBatch bool
	// Dedupe: an idempotency key is applied once; repeats succeed and are
	// reported as Duplicate.
	Dedupe bool
	// VerifiedEpochs: the constructor passes Setup.Verifier to the sink.
	VerifiedEpochs bool
	// Headers: the sink reads stamps from message headers, and
	// Instance.ApplyHeader feeds it raw ones.
	Headers bool
	// RaceGoroutines and RaceOps size the race case: goroutines, and
	// effects per goroutine. Defaults 8 and 40.
	RaceGoroutines, RaceOps int
	// PropertyRuns is how many random sequences the Properties case runs,
	// each against a new sink. Default DefaultPropertyRuns; the environment
	// variable PropertyRunsEnv overrides it.
	PropertyRuns int
	// Parallel: the Constructor may be called from several cases at once
	// (each case's resources are its own, by Setup.Name). Run then runs
	// the cases side by side, and the Properties case's two searches too.
	Parallel bool
	// SkipConcurrent, when set, skips the Properties case's Concurrent
	// search and says why in the test output. Set it only with a reason a
	// reader can act on: the search is what catches check-then-write.
	SkipConcurrent string
}

func (f *Features) setDefaults() {
	if f.RaceGoroutines == 0 {
		f.RaceGoroutines = 8
	}
	if f.RaceOps == 0 {
		f.RaceOps = 40
	}
}

// Setup is what the suite gives a Constructor.
type Setup struct {
	// Name is unique per case: lowercase letters, digits and '_', starting
	// with a letter. Use it in every resource name.
	Name string
	// Observer must receive the sink's decisions.
	Observer sink.Observer
	// Verifier is the lease bucket to verify epochs against; nil except in
	// the verified-epoch case.
	Verifier sink.Verifier
}

// Instance is one sink under test.
type Instance struct {
	Sink sink.Sink
	// Applied returns every effect the sink has applied so far, with at
	// least the stamp's key, the subject and the data. Required.
	Applied func(ctx context.Context) ([]sink.Effect, error)
	// Reopen closes the sink and opens it again on the same storage.
	// Required with Features.Durable.
	Reopen func(ctx context.Context) (sink.Sink, error)
	// Crash stops the sink as a crash of its process would, with nothing
	// flushed or closed in order, and opens it again on the same storage.
	// Optional: the Properties case then crashes it as well as reopening it.
	Crash func(ctx context.Context) (sink.Sink, error)
	// ApplyHeader applies one effect whose stamp travels in raw headers.
	// Required with Features.Headers.
	ApplyHeader func(ctx context.Context, h map[string][]string, subject string, data []byte) error
	// Subject maps a case's effect name (letters, digits and '-') to a
	// subject the sink accepts. Default: the name itself.
	Subject func(name string) string
}

// Constructor builds a fresh sink for one case. Cleanup goes through
// t.Cleanup.
type Constructor func(t *testing.T, s Setup) Instance

// Run runs every case that features allow against sinks built by newSink.
func Run(t *testing.T, features Features, newSink Constructor) {
	t.Helper()
	features.setDefaults()
	cases := []struct {
		name string
		run  func(t *testing.T, h *harness)
		need bool
	}{
		{"FirstEpochAccepted", testFirstEpoch, true},
		{"EqualEpochAccepted", testEqualEpoch, true},
		{"StaleRejected", testStale, true},
		{"PartitionsIndependent", testPartitions, true},
		{"ScopesIndependent", testScopes, true},
		{"SplitBrainRefused", testSplitBrain, true},
		{"AdvanceFencesBeforeFirstWrite", testAdvance, true},
		{"CancelledContext", testCancelled, true},
		{"BadStamp", testBadStamp, true},
		{"Race", testRace, true},
		{"SurvivesReopen", testDurable, features.Durable},
		{"BatchAllOrNothing", testBatch, features.AtomicBatch},
		{"Dedupe", testDedupe, features.Dedupe},
		{"BadHeaders", testHeaders, features.Headers},
		{"ForgedEpochRefused", testForged, features.VerifiedEpochs},
		{"EpochOfAnotherFenceRefused", testOtherFence, features.VerifiedEpochs},
		{"ForgedAcquisitionRefused", testForgedAcquisition, features.VerifiedEpochs},
		{"FormerHolderFarBehind", testFarBehind, features.VerifiedEpochs},
		{"PreviousReleaseRecord", testPreviousRecord, features.VerifiedEpochs},
		{"Properties", testProperties, true},
	}
	for _, c := range cases {
		if !c.need {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			if features.Parallel {
				t.Parallel()
			}
			name := newName(t.Name())
			h := &harness{t: t, f: features, rec: &recorder{}, newSink: newSink, name: name, scope: "jobs-" + name}
			c.run(t, h)
		})
	}
}

// harness builds the case's sink and records its decisions.
type harness struct {
	t       *testing.T
	f       Features
	rec     *recorder
	newSink Constructor
	inst    Instance
	name    string // the case's resource name
	scope   string // the fencing scope of the case's effects: a job stream's
}

func (h *harness) start(v sink.Verifier) sink.Sink {
	h.t.Helper()
	h.inst = h.newSink(h.t, Setup{Name: h.name, Observer: h.rec, Verifier: v})
	if h.inst.Sink == nil || h.inst.Applied == nil {
		h.t.Fatal("sinktest: the constructor must set Instance.Sink and Instance.Applied")
	}
	if h.inst.Subject == nil {
		h.inst.Subject = func(n string) string { return n }
	}
	return h.inst.Sink
}

// effect builds an effect named name (also its subject and data) in the
// case's scope, from the acquisition acq(e).
func (h *harness) effect(p leasehold.Partition, e leasehold.Epoch, name string) sink.Effect {
	return h.effectIn(h.scope, p, e, name)
}

// effectIn builds an effect in scope; its key is the same whatever the
// scope, so that scopes that share a sink also share key spellings. Its
// subject is the scope's own (a destination keeps one value per subject).
func (h *harness) effectIn(scope string, p leasehold.Partition, e leasehold.Epoch, name string) sink.Effect {
	subject := name
	if scope != h.scope {
		sum := sha256.Sum256([]byte(scope))
		subject = name + "-" + hex.EncodeToString(sum[:4])
	}
	return sink.Effect{
		Stamp:   leasehold.Stamp{Scope: scope, Partition: p, Epoch: e, Acquisition: acq(e), Key: h.name + "." + name, Worker: "w" + e.String()},
		Subject: h.inst.Subject(subject),
		Data:    []byte("data of " + name),
	}
}

// acq is the acquisition token the suite gives epoch e: one acquisition per
// epoch, unless a case says otherwise.
func acq(e leasehold.Epoch) string { return "acq" + e.String() }

// lease is the acquisition of epoch e of partition p in the case's scope.
func (h *harness) lease(p leasehold.Partition, e leasehold.Epoch) leasehold.Lease {
	return leasehold.Lease{Scope: h.scope, Partition: p, Epoch: e, Acquisition: acq(e), Holder: "w" + e.String()}
}

// applied returns the applied effects by scope and key.
func (h *harness) applied(ctx context.Context) map[appliedID][]sink.Effect {
	h.t.Helper()
	es, err := h.inst.Applied(ctx)
	if err != nil {
		h.t.Fatalf("sinktest: read applied effects: %v", err)
	}
	out := make(map[appliedID][]sink.Effect, len(es))
	for _, e := range es {
		id := appliedID{e.Stamp.Scope, e.Stamp.Key}
		out[id] = append(out[id], e)
	}
	return out
}

type appliedID struct{ scope, key string }

func idOf(e sink.Effect) appliedID { return appliedID{e.Stamp.Scope, e.Stamp.Key} }

func (h *harness) mustApply(ctx context.Context, s sink.Sink, es ...sink.Effect) {
	h.t.Helper()
	if err := s.Apply(ctx, es...); err != nil {
		h.t.Fatalf("Apply(%s) = %v, want nil", describe(es), err)
	}
}

func (h *harness) wantMax(ctx context.Context, s sink.Sink, p leasehold.Partition, want leasehold.Epoch) {
	h.t.Helper()
	h.wantMaxIn(ctx, s, h.scope, p, want)
}

func (h *harness) wantMaxIn(ctx context.Context, s sink.Sink, scope string, p leasehold.Partition, want leasehold.Epoch) {
	h.t.Helper()
	id := leasehold.FenceID{Scope: scope, Partition: p}
	got, err := s.Fence(ctx, id)
	if err != nil {
		h.t.Fatalf("Fence(%s): %v", id, err)
	}
	if got.Epoch != want {
		h.t.Fatalf("Fence(%s).Epoch = %d, want %d", id, got.Epoch, want)
	}
}

// wantApplied checks that each named effect was applied exactly once
// (present) or not at all.
func (h *harness) wantApplied(ctx context.Context, present []sink.Effect, absent []sink.Effect) {
	h.t.Helper()
	got := h.applied(ctx)
	for _, e := range present {
		es := got[idOf(e)]
		if len(es) != 1 {
			h.t.Fatalf("effect %s of scope %s applied %d times, want once", e.Stamp.Key, e.Stamp.Scope, len(es))
		}
		if string(es[0].Data) != string(e.Data) {
			h.t.Fatalf("effect %s of scope %s applied with data %q, want %q", e.Stamp.Key, e.Stamp.Scope, es[0].Data, e.Data)
		}
	}
	for _, e := range absent {
		if n := len(got[idOf(e)]); n != 0 {
			h.t.Fatalf("effect %s of scope %s (epoch %d) was applied %d times; it must have no effect", e.Stamp.Key, e.Stamp.Scope, e.Stamp.Epoch, n)
		}
	}
}

func describe(es []sink.Effect) string {
	var parts []string
	for _, e := range es {
		parts = append(parts, e.Stamp.Key+"@"+e.Stamp.Scope+"/p"+e.Stamp.Partition.String()+"/e"+e.Stamp.Epoch.String())
	}
	return strings.Join(parts, ", ")
}

// recorder is the Observer the suite hands to every sink.
type recorder struct {
	mu sync.Mutex
	ds []sink.Decision
}

func (r *recorder) Decided(_ context.Context, d sink.Decision) {
	r.mu.Lock()
	r.ds = append(r.ds, d)
	r.mu.Unlock()
}

// find returns the decisions about e's scope and key with outcome o.
func (r *recorder) find(e sink.Effect, o sink.Outcome) []sink.Decision {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []sink.Decision
	for _, d := range r.ds {
		if d.Stamp.Key == e.Stamp.Key && d.Stamp.Scope == e.Stamp.Scope && d.Outcome == o {
			out = append(out, d)
		}
	}
	return out
}

func (r *recorder) count(o sink.Outcome) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, d := range r.ds {
		if d.Outcome == o {
			n++
		}
	}
	return n
}

func newName(testName string) string {
	name := testName
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		name = name[i+1:]
	}
	var b strings.Builder
	b.WriteByte('s')
	for _, c := range strings.ToLower(name) {
		if c >= 'a' && c <= 'z' || c >= '0' && c <= '9' {
			b.WriteRune(c)
		}
		if b.Len() >= 20 {
			break
		}
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	b.WriteByte('_')
	b.WriteString(hex.EncodeToString(rnd[:]))
	return b.String()
}

func isStale(err error) (*leasehold.StaleEpochError, bool) {
	var se *leasehold.StaleEpochError
	if errors.As(err, &se) && errors.Is(err, leasehold.ErrStaleEpoch) {
		return se, true
	}
	return nil, false
}
