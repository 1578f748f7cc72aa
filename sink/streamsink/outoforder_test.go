package streamsink_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
)

// Jobs of one lease that complete out of stream order, as a worker with
// several jobs of a partition in flight sends them: each final carries the
// worker's watermark (Leasehold-Floor) and names in After the job that
// completed before it on the subject, a later one as often as not. The
// worker's order of completion is the order of the finals in the log.

// floorFinal publishes effect i of job's attempt, its final, with the
// watermark floor, under the lease of epoch 1.
func (wl *wireLog) floorFinal(job, attempt uint64, i int, after, floor uint64) uint64 {
	return wl.pub(1, wl.key(job, i), leasehold.JobMark{Job: job, Attempt: attempt, Effects: i + 1, After: after, Floor: floor, Floored: true}, false)
}

// order is the keys applied, in the order they were applied.
func (wl *wireLog) order() []string {
	wl.applied.mu.Lock()
	defer wl.applied.mu.Unlock()
	return slices.Clone(wl.applied.keys)
}

// Six jobs completing in the order 2, 1, 4, 3, 6, 5 (job 3 with two
// effects) all apply, once each, in the order they completed; a job's final
// that comes again, and a re-run of a job applied at or below the floor or
// above it, are duplicates.
func TestOutOfOrderFinalsApplyInCompletionOrder(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "ooo")
	r := start(t, wl.js, wl.cfg)
	wl.floorFinal(2, 2, 0, 0, 0)
	f1 := wl.floorFinal(1, 1, 0, 2, 0) // After names a later job
	wl.floorFinal(4, 4, 0, 1, 2)
	wl.effect(3, 3, 0)
	wl.floorFinal(3, 3, 1, 4, 2)
	wl.floorFinal(6, 6, 0, 3, 4)
	f5 := wl.floorFinal(5, 5, 0, 6, 4)
	wl.wait(r, f5)
	want := []string{"ooo.0.2.0", "ooo.0.1.0", "ooo.0.4.0", "ooo.0.3.0", "ooo.0.3.1", "ooo.0.6.0", "ooo.0.5.0"}
	if got := wl.order(); !slices.Equal(got, want) {
		t.Fatalf("applied %v, want %v", got, want)
	}
	// The chain stands at floor 4 with 5 and 6 above it.
	again := wl.floorFinal(1, 1, 0, 2, 0)
	rerunBelow := wl.floorFinal(3, 7, 0, 5, 2)
	rerunAbove := wl.floorFinal(5, 8, 0, 6, 4)
	wl.wait(r, rerunAbove)
	for _, seq := range []uint64{again, rerunBelow, rerunAbove} {
		wl.outcome(seq, sink.Duplicate)
	}
	wl.outcome(f1, sink.Accepted)
	counts := map[string]int{}
	for _, k := range want {
		counts[k] = 1
	}
	wl.want(counts)
}

// A job that finished without completing on the subject (an attempt
// failed, and the job ran again or went to the dead-letter stream) is
// dropped once a final's floor passes it, and not because a later job
// applied: the later job completing first leaves it open, and its own
// completion after applies.
func TestOutOfOrderFloorDropsFinishedJobs(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "floor")
	r := start(t, wl.js, wl.cfg)
	wl.effect(2, 2, 0) // job 2's first attempt; it fails, and its abort marker is lost
	f3 := wl.floorFinal(3, 3, 0, 0, 1)
	wl.wait(r, f3)
	wl.want(map[string]int{"floor.0.3.0": 1})
	wl.effect(2, 4, 0) // job 2's retry, completing after job 3
	f2 := wl.floorFinal(2, 4, 1, 3, 1)
	wl.wait(r, f2)
	wl.want(map[string]int{"floor.0.3.0": 1, "floor.0.2.0": 1, "floor.0.2.1": 1})
	dead := wl.effect(4, 5, 0) // job 4 goes to the dead-letter stream after this effect
	f6 := wl.floorFinal(6, 6, 0, 2, 3)
	wl.wait(r, f6)
	if _, ok := wl.rec.at(dead); ok {
		t.Fatalf("job 4, above the floor 3, was settled by job 6 applied beside it")
	}
	f5 := wl.floorFinal(5, 7, 0, 6, 4)
	wl.wait(r, f5)
	wl.outcome(dead, sink.Aborted)
	wl.want(map[string]int{"floor.0.3.0": 1, "floor.0.2.0": 1, "floor.0.2.1": 1, "floor.0.6.0": 1, "floor.0.5.0": 1})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	again, err := streamsink.New(ctxFor(t, time.Minute), wl.js, wl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p := again.Position(); p != f5 {
		t.Errorf("saved position %d, want %d: the floor settled every job", p, f5)
	}
}

// A runner that stops in the middle of jobs completing out of order, with
// jobs applied above the floor and jobs open, starts again from what it
// saved (in the position record, or in the applied shards) and applies
// nothing twice and loses nothing.
func TestOutOfOrderAcrossRestart(t *testing.T) {
	for _, c := range []struct {
		name  string
		delta int
	}{{"position", 256}, {"shards", 1}} {
		t.Run(c.name, func(t *testing.T) {
			defer streamsink.SetMaxDelta(c.delta)()
			wl := newWireLog(t, "again"+c.name)
			k := func(job uint64, i int) string { return wl.key(job, i) }
			r := start(t, wl.js, wl.cfg)
			f2 := wl.floorFinal(2, 2, 0, 0, 0)
			f4 := wl.floorFinal(4, 4, 0, 2, 0)
			e1 := wl.effect(1, 1, 0)
			e3 := wl.effect(3, 3, 0)
			wl.wait(r, e3)
			wl.want(map[string]int{k(2, 0): 1, k(4, 0): 1})
			if err := r.stop(); err != nil {
				t.Fatal(err)
			}
			again, err := streamsink.New(ctxFor(t, time.Minute), wl.js, wl.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if p := again.Position(); p >= e1 {
				t.Fatalf("saved position %d passed job 1's open effect at %d", p, e1)
			}
			r2 := run(t, again)
			// The finals applied before come again (a forger's replay, or a
			// runner that read them again): duplicates.
			rep2 := wl.floorFinal(2, 2, 0, 0, 0)
			rep4 := wl.floorFinal(4, 4, 0, 2, 0)
			f1 := wl.floorFinal(1, 1, 1, 4, 0)
			f3 := wl.floorFinal(3, 3, 1, 1, 2)
			f5 := wl.floorFinal(5, 5, 0, 3, 4)
			wl.wait(r2, f5)
			wl.outcome(rep2, sink.Duplicate)
			wl.outcome(rep4, sink.Duplicate)
			all := map[string]int{k(2, 0): 1, k(4, 0): 1, k(1, 0): 1, k(1, 1): 1, k(3, 0): 1, k(3, 1): 1, k(5, 0): 1}
			wl.want(all)
			if err := r2.stop(); err != nil {
				t.Fatal(err)
			}
			// Everything again, from the log's start, to a runner that
			// starts from the saved state: all duplicates.
			r3 := start(t, wl.js, wl.cfg)
			var last uint64
			for _, m := range readLog(t, wl.js, "again"+c.name+"-effects") {
				ack, err := wl.js.PublishMsg(ctxFor(t, 30*time.Second), &nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data})
				if err != nil {
					t.Fatal(err)
				}
				last = ack.Sequence
			}
			wl.wait(r3, last)
			wl.want(all)
			for _, seq := range []uint64{f2, f4, f1, f3, f5} {
				wl.outcome(seq, sink.Accepted)
			}
		})
	}
}

// Finals without a floor (a sequential worker, a release before floors)
// keep the rule they had: applying a job settles every job of its lease up
// to it, so an open job below it is dropped, and completing later it is a
// duplicate.
func TestFinalsWithoutFloorKeepTheOldRule(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "seq")
	r := start(t, wl.js, wl.cfg)
	open := wl.effect(7, 1, 0)
	f8 := wl.final(8, 2, 0, 0)
	late := wl.final(7, 1, 1, 0)
	wl.wait(r, late)
	wl.outcome(open, sink.Aborted)
	wl.outcome(f8, sink.Accepted)
	wl.outcome(late, sink.Duplicate)
	wl.want(map[string]int{"seq.0.8.0": 1})
}

// A chain holding more jobs applied above its floor than the bound stops
// the runner before it delivers anything more: Ready says ErrGroupLimit and
// the gauge counts the jobs; with the bound raised it goes on.
func TestOutOfOrderBound(t *testing.T) {
	restore := streamsink.SetMaxAbove(3)
	defer restore()
	wl := newWireLog(t, "bound")
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	cfg := wl.cfg
	cfg.Telemetry = telemetry.Config{MeterProvider: mp}
	cfg.Name = "bound"
	cfg.AckWait = 4 * time.Second // the runner started again reads job 5 once it is redelivered
	r := start(t, wl.js, cfg)
	// Job 1 never finishes: the floor stays 0.
	wl.floorFinal(2, 2, 0, 0, 0)
	wl.floorFinal(3, 3, 0, 2, 0)
	f := wl.floorFinal(4, 4, 0, 3, 0)
	wl.wait(r, f)
	if n := sinkMetric(t, reader, "bound", "leasehold.sink.jobs_above_floor"); n != 3 {
		t.Errorf("leasehold.sink.jobs_above_floor is %d, want 3", n)
	}
	over := wl.floorFinal(5, 5, 0, 4, 0)
	err := awaitReady(t, ctxFor(t, time.Minute), r.Runner, "Ready to report the bound", func(err error) bool { return err != nil })
	if !errors.Is(err, streamsink.ErrGroupLimit) {
		t.Fatalf("Ready: %v, want ErrGroupLimit", err)
	}
	if got := wl.applied.snapshot()["bound.0.5.0"]; got != 0 {
		t.Errorf("job 5, past the bound, applied %d times", got)
	}
	if err := r.stop(); err != nil && !errors.Is(err, streamsink.ErrGroupLimit) {
		t.Fatal(err)
	}
	restore()
	again := start(t, wl.js, cfg)
	wl.wait(again, over)
	wl.want(map[string]int{"bound.0.2.0": 1, "bound.0.3.0": 1, "bound.0.4.0": 1, "bound.0.5.0": 1})
}
