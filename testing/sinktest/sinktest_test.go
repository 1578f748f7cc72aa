package sinktest_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// flawedSink is a sink with one known defect put back, to show that the
// suite catches it:
//   - checkThenWrite checks the fence and then writes, in two steps: between
//     its check and its write another writer can raise the fence, and its
//     write then lands under a fence that has moved on;
//   - partitionOnly keys fences and dedupe by partition (and key) alone, as
//     sinks did before scopes: two job streams sharing it fence each other;
//   - ignoreAcquisition admits equal epochs whatever acquisition they come
//     from, so two holders handed one revision share the fence.
type flawedSink struct {
	checkThenWrite, partitionOnly, ignoreAcquisition bool
	writes                                           atomic.Int64 // calls that wrote, for checkThenWrite's window

	obs     sink.Observer
	mu      sync.Mutex
	fences  map[leasehold.FenceID]leasehold.FenceState
	keys    map[[2]string]bool
	applied []sink.Effect
}

func (b *flawedSink) id(s leasehold.Stamp) leasehold.FenceID {
	if b.partitionOnly {
		return leasehold.FenceID{Partition: s.Partition}
	}
	return s.Fence()
}

func (b *flawedSink) judge(f leasehold.FenceState, s leasehold.Stamp) (leasehold.Verdict, bool) {
	if b.ignoreAcquisition {
		f.Acquisition = ""
	}
	return leasehold.Judge(f, s)
}

func (b *flawedSink) Apply(ctx context.Context, effects ...sink.Effect) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if i, err := sink.ValidateEffects(effects); err != nil {
		b.obs.Decided(ctx, sink.Decision{Outcome: sink.BadStamp, Stamp: effects[i].Stamp, Err: err})
		return err
	}
	b.mu.Lock()
	locked := true
	unlock := func() {
		if locked {
			b.mu.Unlock()
			locked = false
		}
	}
	defer unlock()
	running := map[leasehold.FenceID]leasehold.FenceState{}
	for _, e := range effects {
		id := b.id(e.Stamp)
		f, ok := running[id]
		if !ok {
			f = b.fences[id]
		}
		v, raise := b.judge(f, e.Stamp)
		if raise {
			running[id] = leasehold.FenceState{Epoch: e.Stamp.Epoch, Acquisition: e.Stamp.Acquisition}
		} else {
			running[id] = f
		}
		if v != leasehold.Admit {
			err := leasehold.Refusal(f, e.Stamp, v)
			unlock()
			b.obs.Decided(ctx, sink.Decision{Outcome: sink.Refused(v), Stamp: e.Stamp, Max: f.Epoch, Err: err})
			return err
		}
	}
	if b.checkThenWrite {
		// A round trip to a database, say, during which other calls
		// write: it lasts until another call has written, or a bounded
		// number of yields when none is running. One yield alone let a
		// busy machine run the calls one after another, and the race
		// case then saw no race.
		seen := b.writes.Load()
		unlock()
		for range 1000 {
			if b.writes.Load() != seen {
				break
			}
			runtime.Gosched()
		}
		b.mu.Lock()
		locked = true
	}
	defer b.writes.Add(1)
	for _, e := range effects {
		id := b.id(e.Stamp)
		if _, raise := b.judge(b.fences[id], e.Stamp); raise {
			b.fences[id] = leasehold.FenceState{Epoch: e.Stamp.Epoch, Acquisition: e.Stamp.Acquisition, Holder: e.Stamp.Worker}
		}
		k := [2]string{e.Stamp.Scope, e.Stamp.Key}
		if b.partitionOnly {
			k[0] = ""
		}
		outcome := sink.Accepted
		if b.keys[k] {
			outcome = sink.Duplicate
		} else {
			b.keys[k] = true
			b.applied = append(b.applied, e)
		}
		b.obs.Decided(ctx, sink.Decision{Outcome: outcome, Stamp: e.Stamp, Max: e.Stamp.Epoch})
	}
	return nil
}

func (b *flawedSink) Advance(ctx context.Context, l leasehold.Lease) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := sink.ValidateAdvance(l); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	s := sink.AdvanceStamp(l)
	id := b.id(s)
	f := b.fences[id]
	v, raise := b.judge(f, s)
	if v != leasehold.Admit {
		return leasehold.Refusal(f, s, v)
	}
	if raise {
		b.fences[id] = leasehold.FenceState{Epoch: l.Epoch, Acquisition: l.Acquisition, Holder: l.Holder}
	}
	return nil
}

func (b *flawedSink) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.partitionOnly {
		id.Scope = ""
	}
	return b.fences[id], nil
}

func newFlawed(flaw string) sinktest.Constructor {
	return func(t *testing.T, s sinktest.Setup) sinktest.Instance {
		b := &flawedSink{obs: s.Observer, fences: map[leasehold.FenceID]leasehold.FenceState{}, keys: map[[2]string]bool{}}
		switch flaw {
		case "check-then-write":
			b.checkThenWrite = true
		case "partition-only":
			b.partitionOnly = true
		case "ignore-acquisition":
			b.ignoreAcquisition = true
		case "":
		default:
			t.Fatalf("unknown flaw %q", flaw)
		}
		return sinktest.Instance{
			Sink: b,
			Applied: func(context.Context) ([]sink.Effect, error) {
				b.mu.Lock()
				defer b.mu.Unlock()
				return append([]sink.Effect(nil), b.applied...), nil
			},
		}
	}
}

// propertyRuns is the flawed sinks' budget of random sequences: a race
// shows in about one sequence in ten, so 200 leave it no room to hide.
const propertyRuns = 200

var features = sinktest.Features{Dedupe: true, AtomicBatch: true, RaceGoroutines: 8, RaceOps: 200, PropertyRuns: propertyRuns}

// TestFlawless: the flawed sink with no flaw passes the suite, so that
// each flaw below is what fails it.
func TestFlawless(t *testing.T) {
	sinktest.Run(t, features, newFlawed(""))
}

// TestFlawedSink is the suite run against one flawed sink. It only runs
// inside TestSuiteCatchesFlaws, which expects it to fail.
func TestFlawedSink(t *testing.T) {
	flaw := os.Getenv("SINKTEST_FLAW")
	if flaw == "" {
		t.Skip("run by TestSuiteCatchesFlaws")
	}
	sinktest.Run(t, features, newFlawed(flaw))
}

// TestSuiteCatchesFlaws runs the suite against each flawed sink in a child
// test process and requires that exactly the cases named fail it, with a
// message that says what went wrong; the property test among them, with
// its own message (a shrunk sequence where the failure reproduces).
func TestSuiteCatchesFlaws(t *testing.T) {
	if os.Getenv("SINKTEST_FLAW") != "" {
		t.Skip("inside the child process")
	}
	for _, c := range []struct {
		flaw     string
		cases    []string
		say      string
		property string
	}{
		// A race reproduces only now and then, so rapid may not shrink it.
		{"check-then-write", []string{"Race", "Properties"}, "a stale write landed after the fence rose", "no order of the concurrent calls"},
		{"partition-only", []string{"ScopesIndependent", "BatchAllOrNothing", "Dedupe", "Properties"}, "below the recorded", "[rapid] failed after"},
		{"ignore-acquisition", []string{"SplitBrainRefused", "BatchAllOrNothing", "Properties"}, "want a split-brain", "[rapid] failed after"},
	} {
		t.Run(c.flaw, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestFlawedSink$", "-test.v", "-test.count=1",
				fmt.Sprintf("-rapid.checks=%d", propertyRuns), "-rapid.nofailfile")
			cmd.Env = append(os.Environ(), "SINKTEST_FLAW="+c.flaw)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("the suite passed a sink with the flaw %s:\n%s", c.flaw, out)
			}
			text := string(out)
			failed := map[string]bool{}
			for _, line := range strings.Split(text, "\n") {
				if name, ok := strings.CutPrefix(strings.TrimSpace(line), "--- FAIL: TestFlawedSink/"); ok {
					name, _, _ = strings.Cut(strings.Fields(name)[0], "/")
					failed[name] = true
				}
			}
			for _, want := range c.cases {
				if !failed[want] {
					t.Errorf("case %s did not fail the flaw %s", want, c.flaw)
				}
			}
			if len(failed) > len(c.cases) {
				t.Errorf("the flaw %s failed %d cases (%v), want only %v", c.flaw, len(failed), keys(failed), c.cases)
			}
			says := []string{c.say, c.property}
			if c.flaw == "check-then-write" {
				// The failing run's own history, whether or not it replays.
				says = append(says, "sinktest: the failing run, as it ran:", "snapshot 1 [")
			}
			for _, say := range says {
				if !strings.Contains(text, say) {
					t.Errorf("the output for %s does not say %q", c.flaw, say)
				}
			}
			if t.Failed() {
				t.Logf("child output:\n%s", text)
			}
		})
	}
}

func keys(m map[string]bool) string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return fmt.Sprint(out)
}
