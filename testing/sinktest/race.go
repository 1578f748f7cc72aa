package sinktest

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// op is one Apply in the race, with logical start and end times from a
// shared counter: op a happened before op b when a.end < b.start.
type op struct {
	e          sink.Effect
	start, end int64
	err        error
}

// testRace has many goroutines apply effects with mixed, rising epochs to
// one partition, then checks the history against the contract:
//   - every refusal is a stale-epoch error, and is justified by an accepted
//     effect of higher epoch that had started before the refusal returned;
//   - no effect was accepted after an effect of a higher epoch had been
//     accepted and returned (the fence never goes back);
//   - accepted effects were applied once, refused ones not at all;
//   - no effect below an epoch appeared among the applied effects after
//     an effect of that epoch had been accepted (checked against snapshots
//     of the applied effects taken when the highest accepted epoch rose);
//   - the final maximum is the highest accepted epoch.
//
// A sink that checks and then writes in two steps fails the second check.
func testRace(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	const p = leasehold.Partition(16)
	g, n := h.f.RaceGoroutines, h.f.RaceOps
	var clock atomic.Int64
	ops := make([][]op, g)
	var snapMu sync.Mutex
	var highest leasehold.Epoch
	var snaps []snapshot
	var wg sync.WaitGroup
	for gi := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(gi), 7))
			for i := range n {
				// Epochs rise with i and jitter across goroutines, so that
				// fresh and stale effects interleave.
				e := leasehold.Epoch(1 + i/4 + rng.IntN(4))
				o := op{e: h.effect(p, e, fmt.Sprintf("race-%d-%d", gi, i))}
				o.start = clock.Add(1)
				o.err = s.Apply(ctx, o.e)
				o.end = clock.Add(1)
				ops[gi] = append(ops[gi], o)
				if o.err == nil {
					snapMu.Lock()
					rose := e > highest
					if rose {
						highest = e
					}
					snapMu.Unlock()
					if rose {
						if es, err := h.inst.Applied(ctx); err == nil {
							sn := snapshot{epoch: e, keys: map[string]bool{}}
							for _, a := range es {
								sn.keys[a.Stamp.Key] = true
							}
							snapMu.Lock()
							snaps = append(snaps, sn)
							snapMu.Unlock()
						}
					}
				}
				if ctx.Err() != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	var all []op
	for _, os := range ops {
		all = append(all, os...)
	}
	checkHistory(t, all)

	highest = 0
	var present, absent []sink.Effect
	for _, o := range all {
		if o.err == nil {
			present = append(present, o.e)
			highest = max(highest, o.e.Stamp.Epoch)
		} else {
			absent = append(absent, o.e)
		}
	}
	h.wantMax(ctx, s, p, highest)
	h.wantApplied(ctx, present, absent)
	for _, o := range all {
		if o.err != nil {
			continue
		}
		for _, sn := range snaps {
			if o.e.Stamp.Epoch < sn.epoch && !sn.keys[o.e.Stamp.Key] {
				t.Fatalf("effect %s (epoch %d) was applied after an effect of epoch %d had been accepted: a stale write landed after the fence rose",
					o.e.Stamp.Key, o.e.Stamp.Epoch, sn.epoch)
			}
		}
	}
}

// snapshot is the set of applied keys seen right after an accepted effect
// raised the highest accepted epoch to epoch.
type snapshot struct {
	epoch leasehold.Epoch
	keys  map[string]bool
}

// checkHistory checks the real-time order of accepted and refused effects.
func checkHistory(t *testing.T, all []op) {
	t.Helper()
	accepted := make([]op, 0, len(all))
	for _, o := range all {
		if o.err == nil {
			accepted = append(accepted, o)
			continue
		}
		se, ok := isStale(o.err)
		if !ok {
			t.Fatalf("Apply(%s) = %v; the only refusal allowed in the race is a stale epoch", o.e.Stamp.Key, o.err)
		}
		if se.Max <= o.e.Stamp.Epoch {
			t.Fatalf("Apply(%s, epoch %d) was refused with max %d, which does not exceed it", o.e.Stamp.Key, o.e.Stamp.Epoch, se.Max)
		}
	}
	if len(accepted) == 0 {
		t.Fatal("no effect of the race was accepted")
	}
	// highestBefore(x) is the highest epoch accepted by an op that returned
	// before logical time x.
	sort.Slice(accepted, func(i, j int) bool { return accepted[i].end < accepted[j].end })
	prefix := make([]leasehold.Epoch, len(accepted))
	var m leasehold.Epoch
	for i, a := range accepted {
		m = max(m, a.e.Stamp.Epoch)
		prefix[i] = m
	}
	highestBefore := func(x int64) (leasehold.Epoch, int) {
		i := sort.Search(len(accepted), func(i int) bool { return accepted[i].end >= x }) - 1
		if i < 0 {
			return 0, -1
		}
		return prefix[i], i
	}
	violations := 0
	var first error
	for _, o := range all {
		if o.err != nil {
			// A refusal needs an accepted effect of higher epoch that
			// started before the refusal returned.
			justified := false
			for _, a := range accepted {
				if a.start < o.end && a.e.Stamp.Epoch > o.e.Stamp.Epoch {
					justified = true
					break
				}
			}
			if !justified {
				violations++
				if first == nil {
					first = fmt.Errorf("effect %s (epoch %d) was refused, but no effect of a higher epoch had been accepted by then", o.e.Stamp.Key, o.e.Stamp.Epoch)
				}
			}
			continue
		}
		if hb, i := highestBefore(o.start); o.e.Stamp.Epoch < hb {
			violations++
			if first == nil {
				first = fmt.Errorf("effect %s (epoch %d) was accepted after an accepted effect of epoch %d had returned (%s): a stale write landed after the fence rose",
					o.e.Stamp.Key, o.e.Stamp.Epoch, hb, accepted[i].e.Stamp.Key)
			}
		}
	}
	if violations > 0 {
		t.Fatalf("the fence is not atomic with the write: %d of %d effects break the contract; first: %v", violations, len(all), first)
	}
}
