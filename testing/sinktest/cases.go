package sinktest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

func caseCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func testFirstEpoch(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	h.wantMax(ctx, s, 0, 0)
	e := h.effect(0, 1, "first")
	h.mustApply(ctx, s, e)
	h.wantMax(ctx, s, 0, 1)
	h.wantApplied(ctx, []sink.Effect{e}, nil)
	if len(h.rec.find(e, sink.Accepted)) != 1 {
		t.Fatalf("the observer saw no Accepted decision for %s", e.Stamp.Key)
	}
}

func testEqualEpoch(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	a, b, c := h.effect(1, 5, "eq-a"), h.effect(1, 5, "eq-b"), h.effect(1, 5, "eq-c")
	h.mustApply(ctx, s, a)
	h.mustApply(ctx, s, b)
	h.mustApply(ctx, s, c)
	h.wantMax(ctx, s, 1, 5)
	h.wantApplied(ctx, []sink.Effect{a, b, c}, nil)
}

func testStale(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	newer, older := h.effect(2, 7, "newer"), h.effect(2, 5, "older")
	h.mustApply(ctx, s, newer)
	err := s.Apply(ctx, older)
	se, ok := isStale(err)
	if !ok {
		t.Fatalf("Apply(epoch 5 after 7) = %v, want a *leasehold.StaleEpochError matching ErrStaleEpoch", err)
	}
	if se.Scope != h.scope || se.Partition != 2 || se.Epoch != 5 || se.Max != 7 || se.Key != older.Stamp.Key || se.SplitBrain {
		t.Fatalf("stale error %+v, want scope %s, partition 2, epoch 5, max 7, key %s", *se, h.scope, older.Stamp.Key)
	}
	if !strings.Contains(err.Error(), "below the recorded 7") {
		t.Fatalf("stale error %q does not say what happened", err)
	}
	h.wantMax(ctx, s, 2, 7)
	h.wantApplied(ctx, []sink.Effect{newer}, []sink.Effect{older})
	ds := h.rec.find(older, sink.Stale)
	if len(ds) != 1 || ds[0].Max != 7 || !errors.Is(ds[0].Err, leasehold.ErrStaleEpoch) {
		t.Fatalf("observer saw %+v for the stale effect, want one Stale decision with max 7", ds)
	}
	if dc, ok := s.(sink.DropCounter); ok {
		if n := dc.Dropped(leasehold.FenceID{Scope: h.scope, Partition: 2}); n != 1 {
			t.Fatalf("Dropped(%s/2) = %d, want 1", h.scope, n)
		}
		if n := dc.Dropped(leasehold.FenceID{Scope: h.scope, Partition: 3}); n != 0 {
			t.Fatalf("Dropped(%s/3) = %d, want 0", h.scope, n)
		}
		if n := dc.Dropped(leasehold.FenceID{Scope: h.scope + "-other", Partition: 2}); n != 0 {
			t.Fatalf("Dropped of another scope's partition 2 = %d, want 0", n)
		}
	}
	// Equal to the recorded maximum is still fine after a refusal.
	again := h.effect(2, 7, "newer-again")
	h.mustApply(ctx, s, again)
}

func testPartitions(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	hi, lo := h.effect(3, 9, "p3-hi"), h.effect(4, 3, "p4-lo")
	h.mustApply(ctx, s, hi)
	h.mustApply(ctx, s, lo)
	h.wantMax(ctx, s, 3, 9)
	h.wantMax(ctx, s, 4, 3)
	h.wantMax(ctx, s, 5, 0)
	h.wantApplied(ctx, []sink.Effect{hi, lo}, nil)
}

// testScopes runs two job streams and a lock through one sink, each with
// the same partition numbers and idempotency keys and very different
// epochs: nothing of one is refused, or admitted, because of another.
func testScopes(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	orders, payments, lock := h.scope, h.scope+"-payments", leasehold.LockScope(h.name+"-locks", "report:1")
	// payments' lease bucket was created later: its epochs are far higher.
	hi := h.effectIn(payments, 3, 1_700_000_000_000_000, "job-1")
	lo := h.effectIn(orders, 3, 1_000, "job-1")
	lk := h.effectIn(lock, 0, 500, "job-1")
	h.mustApply(ctx, s, hi)
	h.mustApply(ctx, s, lo)
	h.mustApply(ctx, s, lk)
	h.wantMaxIn(ctx, s, payments, 3, 1_700_000_000_000_000)
	h.wantMaxIn(ctx, s, orders, 3, 1_000)
	h.wantMaxIn(ctx, s, lock, 0, 500)
	h.wantMaxIn(ctx, s, orders, 0, 0)
	// Advancing one scope's partition fences that scope alone.
	if err := s.Advance(ctx, leasehold.Lease{Scope: orders, Partition: 3, Epoch: 2_000, Acquisition: acq(2_000), Holder: "w2000"}); err != nil {
		t.Fatalf("Advance(orders/3, 2000): %v", err)
	}
	zombie := h.effectIn(orders, 3, 1_000, "job-2")
	if se, ok := isStale(s.Apply(ctx, zombie)); !ok || se.Scope != orders || se.Max != 2_000 {
		t.Fatalf("a zombie of %s after its own take-over: %+v, want a stale-epoch error of scope %s with max 2000", orders, se, orders)
	}
	// payments' and the lock's holders carry on, at their own epochs.
	hi2 := h.effectIn(payments, 3, 1_700_000_000_000_000, "job-2")
	lk2 := h.effectIn(lock, 0, 500, "job-2")
	h.mustApply(ctx, s, hi2)
	h.mustApply(ctx, s, lk2)
	// A zombie of payments is refused by payments' fence alone.
	pz := h.effectIn(payments, 3, 1_699_999_999_999_999, "job-3")
	if se, ok := isStale(s.Apply(ctx, pz)); !ok || se.Scope != payments {
		t.Fatalf("a zombie of %s: %v, want a stale-epoch error of that scope", payments, s.Apply(ctx, pz))
	}
	h.wantMaxIn(ctx, s, orders, 3, 2_000)
	h.wantApplied(ctx, []sink.Effect{hi, lo, lk, hi2, lk2}, []sink.Effect{zombie, pz})
	if dc, ok := s.(sink.DropCounter); ok {
		if n := dc.Dropped(leasehold.FenceID{Scope: lock, Partition: 0}); n != 0 {
			t.Fatalf("the lock's fence counts %d drops, want 0", n)
		}
	}
}

// testSplitBrain: two acquisitions handed one epoch (a lease bucket that
// lost acknowledged writes) must not share the fence.
func testSplitBrain(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	first := h.effect(17, 7, "split-first")
	h.mustApply(ctx, s, first)
	twin := h.effect(17, 7, "split-twin")
	twin.Stamp.Acquisition, twin.Stamp.Worker = "another", "w-twin"
	err := s.Apply(ctx, twin)
	se, ok := isStale(err)
	if !ok || !errors.Is(err, leasehold.ErrSplitBrain) || !se.SplitBrain || se.MaxAcquisition != acq(7) || se.Acquisition != "another" {
		t.Fatalf("Apply(epoch 7 from another acquisition) = %v, want a split-brain *leasehold.StaleEpochError naming both acquisitions", err)
	}
	if len(h.rec.find(twin, sink.SplitBrain)) != 1 {
		t.Fatal("the observer saw no SplitBrain decision for the twin's write")
	}
	twinLease := h.lease(17, 7)
	twinLease.Acquisition = "another"
	if err := s.Advance(ctx, twinLease); !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("Advance(epoch 7, another acquisition) = %v, want ErrSplitBrain", err)
	}
	// The first acquisition carries on; a later epoch moves the fence on.
	again := h.effect(17, 7, "split-again")
	h.mustApply(ctx, s, again)
	next := h.effect(17, 8, "split-next")
	h.mustApply(ctx, s, next)
	if f, err := s.Fence(ctx, leasehold.FenceID{Scope: h.scope, Partition: 17}); err != nil || f.Epoch != 8 || f.Acquisition != acq(8) {
		t.Fatalf("Fence = %+v, %v; want epoch 8 of acquisition %s", f, err, acq(8))
	}
	h.wantApplied(ctx, []sink.Effect{first, again, next}, []sink.Effect{twin})
}

func testAdvance(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	old := h.effect(6, 4, "before-takeover")
	h.mustApply(ctx, s, old)
	// The new holder acquired epoch 10 and has not written yet.
	if err := s.Advance(ctx, h.lease(6, 10)); err != nil {
		t.Fatalf("Advance(6, 10): %v", err)
	}
	if f, err := s.Fence(ctx, leasehold.FenceID{Scope: h.scope, Partition: 6}); err != nil || f.Acquisition != acq(10) {
		t.Fatalf("Fence after Advance = %+v, %v; want acquisition %s recorded", f, err, acq(10))
	}
	// The same acquisition advancing again is a no-op.
	if err := s.Advance(ctx, h.lease(6, 10)); err != nil {
		t.Fatalf("Advance(6, 10) again: %v, want nil", err)
	}
	h.wantMax(ctx, s, 6, 10)
	zombie := h.effect(6, 4, "zombie")
	if _, ok := isStale(s.Apply(ctx, zombie)); !ok {
		t.Fatal("a write of the former holder after the take-over was not refused")
	}
	// Advancing to a lower epoch is refused, like a write of that epoch:
	// the caller is no longer the newest holder, and must stop.
	err := s.Advance(ctx, h.lease(6, 8))
	if se, ok := isStale(err); !ok || se.Max != 10 || se.Epoch != 8 {
		t.Fatalf("Advance(6, 8) below the maximum 10 = %v, want a stale-epoch error with epoch 8 and max 10", err)
	}
	h.wantMax(ctx, s, 6, 10)
	holder := h.effect(6, 10, "new-holder")
	h.mustApply(ctx, s, holder)
	if err := s.Advance(ctx, h.lease(6, 0)); !errors.Is(err, leasehold.ErrBadStamp) {
		t.Fatalf("Advance(6, 0) = %v, want an error matching ErrBadStamp", err)
	}
	noScope := h.lease(6, 11)
	noScope.Scope = ""
	if err := s.Advance(ctx, noScope); !errors.Is(err, leasehold.ErrBadStamp) {
		t.Fatalf("Advance without a scope = %v, want an error matching ErrBadStamp", err)
	}
	h.wantMax(ctx, s, 6, 10)
	h.wantApplied(ctx, []sink.Effect{old, holder}, []sink.Effect{zombie})
}

func testCancelled(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	h.mustApply(ctx, s, h.effect(7, 3, "before"))
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	e := h.effect(7, 5, "cancelled")
	if err := s.Apply(cctx, e); !errors.Is(err, context.Canceled) {
		t.Fatalf("Apply with a cancelled context = %v, want an error matching context.Canceled", err)
	}
	if err := s.Advance(cctx, h.lease(7, 9)); !errors.Is(err, context.Canceled) {
		t.Fatalf("Advance with a cancelled context = %v, want an error matching context.Canceled", err)
	}
	h.wantMax(ctx, s, 7, 3)
	h.wantApplied(ctx, nil, []sink.Effect{e})
}

func testBadStamp(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	good := h.effect(8, 2, "good")
	h.mustApply(ctx, s, good)
	bad := map[string]sink.Effect{}
	e := h.effect(8, 0, "zero-epoch")
	bad["zero epoch"] = e
	e = h.effect(8, leasehold.MaxEpoch+1, "huge-epoch")
	bad["epoch above MaxEpoch"] = e
	e = h.effect(8, 3, "empty-key")
	e.Stamp.Key = ""
	bad["empty key"] = e
	e = h.effect(8, 3, "space-key")
	e.Stamp.Key += " x"
	bad["key with a space"] = e
	e = h.effect(leasehold.MaxPartitions, 3, "bad-partition")
	bad["partition out of range"] = e
	e = h.effect(8, 3, "no-scope")
	e.Stamp.Scope = ""
	bad["empty scope"] = e
	e = h.effect(8, 3, "spaced-scope")
	e.Stamp.Scope = "jobs x"
	bad["scope with a space"] = e
	e = h.effect(8, 3, "no-acquisition")
	e.Stamp.Acquisition = ""
	bad["empty acquisition"] = e
	for what, e := range bad {
		err := s.Apply(ctx, e)
		if !errors.Is(err, leasehold.ErrBadStamp) {
			t.Fatalf("%s: Apply = %v, want an error matching leasehold.ErrBadStamp", what, err)
		}
		if !strings.Contains(err.Error(), "Leasehold-") {
			t.Fatalf("%s: error %q does not name the header", what, err)
		}
	}
	if h.rec.count(sink.BadStamp) < len(bad) {
		t.Fatalf("the observer saw %d BadStamp decisions, want %d", h.rec.count(sink.BadStamp), len(bad))
	}
	h.wantMax(ctx, s, 8, 2)
	var absent []sink.Effect
	for _, e := range bad {
		if e.Stamp.Key != "" {
			absent = append(absent, e)
		}
	}
	h.wantApplied(ctx, []sink.Effect{good}, absent)
}

func testDurable(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	if h.inst.Reopen == nil {
		t.Fatal("sinktest: Features.Durable needs Instance.Reopen")
	}
	a := h.effect(9, 7, "durable")
	h.mustApply(ctx, s, a)
	if err := s.Advance(ctx, h.lease(10, 9)); err != nil {
		t.Fatal(err)
	}
	other := h.effectIn(h.scope+"-b", 9, 3, "durable")
	h.mustApply(ctx, s, other)
	s, err := h.inst.Reopen(ctx)
	if err != nil {
		t.Fatalf("Reopen: %v", err)
	}
	h.inst.Sink = s
	h.wantMax(ctx, s, 9, 7)
	h.wantMax(ctx, s, 10, 9)
	h.wantMaxIn(ctx, s, h.scope+"-b", 9, 3)
	if f, err := s.Fence(ctx, leasehold.FenceID{Scope: h.scope, Partition: 10}); err != nil || f.Acquisition != acq(9) {
		t.Fatalf("after reopen, Fence = %+v, %v; want the acquisition %s", f, err, acq(9))
	}
	split := h.effect(10, 9, "after-reopen-split")
	split.Stamp.Acquisition = "another"
	if err := s.Apply(ctx, split); !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("after reopen, a write of epoch 9 from another acquisition = %v, want ErrSplitBrain", err)
	}
	stale := h.effect(9, 6, "after-reopen-stale")
	if _, ok := isStale(s.Apply(ctx, stale)); !ok {
		t.Fatal("after reopen, a stale effect was not refused")
	}
	zombie := h.effect(10, 8, "after-reopen-zombie")
	if _, ok := isStale(s.Apply(ctx, zombie)); !ok {
		t.Fatal("after reopen, the advanced maximum did not refuse an older epoch")
	}
	h.wantApplied(ctx, []sink.Effect{a, other}, []sink.Effect{stale, zombie, split})
}

func testBatch(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	if err := s.Advance(ctx, h.lease(12, 5)); err != nil {
		t.Fatal(err)
	}
	ok1, stale := h.effect(11, 3, "batch-ok"), h.effect(12, 4, "batch-stale")
	err := s.Apply(ctx, ok1, stale)
	if _, isSt := isStale(err); !isSt {
		t.Fatalf("Apply(batch with a stale effect) = %v, want a stale-epoch error", err)
	}
	h.wantMax(ctx, s, 11, 0)
	bad := h.effect(12, 0, "batch-bad")
	if err := s.Apply(ctx, ok1, bad); !errors.Is(err, leasehold.ErrBadStamp) {
		t.Fatalf("Apply(batch with a bad stamp) = %v, want ErrBadStamp", err)
	}
	h.wantApplied(ctx, nil, []sink.Effect{ok1, stale})
	// A stale effect after an admitted one of the same partition, within
	// one batch, fails the batch too.
	up, down := h.effect(13, 6, "batch-up"), h.effect(13, 5, "batch-down")
	if _, isSt := isStale(s.Apply(ctx, up, down)); !isSt {
		t.Fatal("a batch whose second effect is below its first (same partition) was accepted")
	}
	h.wantMax(ctx, s, 13, 0)
	// So does a split-brain effect.
	split := h.effect(12, 5, "batch-split")
	split.Stamp.Acquisition = "another"
	if err := s.Apply(ctx, ok1, split); !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("Apply(batch with a split-brain effect) = %v, want ErrSplitBrain", err)
	}
	h.wantMax(ctx, s, 11, 0)
	a, b := h.effect(11, 3, "batch-a"), h.effect(12, 5, "batch-b")
	h.mustApply(ctx, s, a, b)
	h.wantMax(ctx, s, 11, 3)
	h.wantMax(ctx, s, 12, 5)
	h.wantApplied(ctx, []sink.Effect{a, b}, []sink.Effect{ok1, stale, up, down, split})
	// Effects of two scopes in one batch are judged by their own fences.
	c, d := h.effect(12, 5, "batch-c"), h.effectIn(h.scope+"-b", 12, 1, "batch-c")
	h.mustApply(ctx, s, c, d)
	h.wantMaxIn(ctx, s, h.scope+"-b", 12, 1)
}

func testDedupe(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	e := h.effect(14, 5, "once")
	h.mustApply(ctx, s, e)
	h.mustApply(ctx, s, e)
	// The same job re-run by the next holder emits the same key.
	rerun := e
	rerun.Stamp.Epoch, rerun.Stamp.Acquisition = 6, acq(6)
	rerun.Data = []byte("second run")
	h.mustApply(ctx, s, rerun)
	h.wantMax(ctx, s, 14, 6)
	h.wantApplied(ctx, []sink.Effect{e}, nil)
	if n := len(h.rec.find(e, sink.Duplicate)); n != 2 {
		t.Fatalf("the observer saw %d Duplicate decisions for %s, want 2", n, e.Stamp.Key)
	}
	// A zombie repeating an applied key is still told it is stale.
	zombie := e
	zombie.Stamp.Epoch, zombie.Stamp.Acquisition = 4, acq(4)
	if _, ok := isStale(s.Apply(ctx, zombie)); !ok {
		t.Fatal("a stale repeat of an applied key was not refused as stale")
	}
	// The same key in another scope is another effect.
	elsewhere := h.effectIn(h.scope+"-b", 14, 2, "once")
	elsewhere.Data = []byte("data of once, elsewhere")
	h.mustApply(ctx, s, elsewhere)
	h.wantApplied(ctx, []sink.Effect{e, elsewhere}, nil)
	if h.f.AtomicBatch {
		f := h.effect(14, 6, "in-batch")
		h.mustApply(ctx, s, f, f, rerun)
		h.wantApplied(ctx, []sink.Effect{e, f, elsewhere}, nil)
	}
}

// testHeaders feeds raw headers to a sink that reads stamps from them.
func testHeaders(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	if h.inst.ApplyHeader == nil {
		t.Fatal("sinktest: Features.Headers needs Instance.ApplyHeader")
	}
	stamp := leasehold.Stamp{Scope: h.scope, Partition: 15, Epoch: 4, Acquisition: acq(4), Key: h.name + ".hdr-ok"}
	lower := map[string][]string{}
	for k, v := range stampHeader(stamp) {
		lower[strings.ToLower(k)] = v
	}
	if err := h.inst.ApplyHeader(ctx, lower, h.inst.Subject("hdr-ok"), []byte("data of hdr-ok")); err != nil {
		t.Fatalf("lower-case header names: %v, want nil", err)
	}
	cases := map[string]func(map[string][]string){
		"missing epoch":     func(m map[string][]string) { delete(m, leasehold.HeaderEpoch) },
		"empty epoch":       func(m map[string][]string) { m[leasehold.HeaderEpoch] = []string{""} },
		"padded epoch":      func(m map[string][]string) { m[leasehold.HeaderEpoch] = []string{"007"} },
		"signed epoch":      func(m map[string][]string) { m[leasehold.HeaderEpoch] = []string{"-5"} },
		"garbled epoch":     func(m map[string][]string) { m[leasehold.HeaderEpoch] = []string{"4x"} },
		"missing partition": func(m map[string][]string) { delete(m, leasehold.HeaderPartition) },
		"missing key":       func(m map[string][]string) { delete(m, leasehold.HeaderKey) },
		"missing scope":     func(m map[string][]string) { delete(m, leasehold.HeaderScope) },
		"empty scope":       func(m map[string][]string) { m[leasehold.HeaderScope] = []string{""} },
		"missing acquisition": func(m map[string][]string) {
			delete(m, leasehold.HeaderAcquisition)
		},
		"conflicting scopes": func(m map[string][]string) {
			m["leasehold-scope"] = []string{"payments"}
		},
		"conflicting epochs": func(m map[string][]string) {
			m["leasehold-epoch"] = []string{"9"}
		},
	}
	for what, mutate := range cases {
		st := stamp
		st.Key = h.name + ".hdr-" + strings.ReplaceAll(what, " ", "-")
		m := stampHeader(st)
		mutate(m)
		err := h.inst.ApplyHeader(ctx, m, h.inst.Subject("hdr-bad"), []byte("bad"))
		if !errors.Is(err, leasehold.ErrBadStamp) || !strings.Contains(err.Error(), "Leasehold-") {
			t.Fatalf("%s: ApplyHeader = %v, want an error matching ErrBadStamp that names the header", what, err)
		}
	}
	h.wantMax(ctx, s, 15, 4)
	got := h.applied(ctx)
	if n := len(got[appliedID{stamp.Scope, stamp.Key}]); n != 1 {
		t.Fatalf("the effect with lower-case headers was applied %d times, want once", n)
	}
	for k := range got {
		if strings.Contains(k.key, ".hdr-") && k.key != stamp.Key {
			t.Fatalf("an effect with bad headers was applied: %s", k.key)
		}
	}
}

func stampHeader(s leasehold.Stamp) map[string][]string {
	m := map[string][]string{}
	s.SetHeader(m)
	return m
}
