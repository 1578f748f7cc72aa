package sinktest_test

import (
	"context"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// brokenSink checks the fence and then writes, in two steps: the bug every
// sink must avoid. Between its check and its write another writer can raise
// the maximum, and its write then lands under a fence that has moved on
// (and puts the maximum back).
type brokenSink struct {
	obs     sink.Observer
	mu      sync.Mutex
	max     map[leasehold.Partition]leasehold.Epoch
	applied []sink.Effect
}

func (b *brokenSink) Apply(ctx context.Context, effects ...sink.Effect) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if i, err := sink.ValidateEffects(effects); err != nil {
		b.obs.Decided(ctx, sink.Decision{Outcome: sink.BadStamp, Stamp: effects[i].Stamp, Err: err})
		return err
	}
	for _, e := range effects {
		b.mu.Lock()
		max := b.max[e.Stamp.Partition]
		b.mu.Unlock()
		if e.Stamp.Epoch < max {
			err := sink.StaleError(e.Stamp, max, "")
			b.obs.Decided(ctx, sink.Decision{Outcome: sink.Stale, Stamp: e.Stamp, Max: max, Err: err})
			return err
		}
		runtime.Gosched() // a round trip to a database, say
		b.mu.Lock()
		b.applied = append(b.applied, e)
		b.max[e.Stamp.Partition] = e.Stamp.Epoch
		b.mu.Unlock()
		b.obs.Decided(ctx, sink.Decision{Outcome: sink.Accepted, Stamp: e.Stamp, Max: e.Stamp.Epoch})
	}
	return nil
}

func (b *brokenSink) Advance(ctx context.Context, p leasehold.Partition, e leasehold.Epoch) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := sink.ValidateAdvance(p, e); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if e > b.max[p] {
		b.max[p] = e
	}
	return nil
}

func (b *brokenSink) MaxEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.max[p], nil
}

func newBroken(t *testing.T, s sinktest.Setup) sinktest.Instance {
	b := &brokenSink{obs: s.Observer, max: map[leasehold.Partition]leasehold.Epoch{}}
	return sinktest.Instance{
		Sink: b,
		Applied: func(context.Context) ([]sink.Effect, error) {
			b.mu.Lock()
			defer b.mu.Unlock()
			return append([]sink.Effect(nil), b.applied...), nil
		},
	}
}

// TestBrokenSink is the suite run against the broken sink. It only runs
// inside TestBrokenSinkFailsSuite, which expects it to fail.
func TestBrokenSink(t *testing.T) {
	if os.Getenv("SINKTEST_RUN_BROKEN") != "1" {
		t.Skip("run by TestBrokenSinkFailsSuite")
	}
	sinktest.Run(t, sinktest.Features{RaceGoroutines: 8, RaceOps: 200}, newBroken)
}

// TestBrokenSinkFailsSuite runs the suite against a sink that checks and
// then writes, in a child test process, and requires that the race case
// fails it (and that it passes the sequential cases, so that the race case
// is what catches it).
func TestBrokenSinkFailsSuite(t *testing.T) {
	if os.Getenv("SINKTEST_RUN_BROKEN") == "1" {
		t.Skip("inside the child process")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenSink$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "SINKTEST_RUN_BROKEN=1")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("the suite passed a sink that checks and then writes:\n%s", out)
	}
	text := string(out)
	for _, want := range []string{
		"--- FAIL: TestBrokenSink/Race",
		"the fence is not atomic with the write",
	} {
		if !strings.Contains(text, want) {
			t.Fatalf("child output lacks %q:\n%s", want, text)
		}
	}
	if n := strings.Count(text, "--- FAIL: TestBrokenSink/"); n != 1 {
		t.Fatalf("%d cases failed the broken sink, want only the race case:\n%s", n, text)
	}
}
