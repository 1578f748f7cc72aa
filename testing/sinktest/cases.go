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
	if len(h.rec.find(e.Stamp.Key, sink.Accepted)) != 1 {
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
	if se.Partition != 2 || se.Epoch != 5 || se.Max != 7 || se.Key != older.Stamp.Key {
		t.Fatalf("stale error %+v, want partition 2, epoch 5, max 7, key %s", *se, older.Stamp.Key)
	}
	if !strings.Contains(err.Error(), "below the recorded 7") {
		t.Fatalf("stale error %q does not say what happened", err)
	}
	h.wantMax(ctx, s, 2, 7)
	h.wantApplied(ctx, []sink.Effect{newer}, []sink.Effect{older})
	ds := h.rec.find(older.Stamp.Key, sink.Stale)
	if len(ds) != 1 || ds[0].Max != 7 || !errors.Is(ds[0].Err, leasehold.ErrStaleEpoch) {
		t.Fatalf("observer saw %+v for the stale effect, want one Stale decision with max 7", ds)
	}
	if dc, ok := s.(sink.DropCounter); ok {
		if n := dc.Dropped(2); n != 1 {
			t.Fatalf("Dropped(2) = %d, want 1", n)
		}
		if n := dc.Dropped(3); n != 0 {
			t.Fatalf("Dropped(3) = %d, want 0", n)
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

func testAdvance(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	old := h.effect(6, 4, "before-takeover")
	h.mustApply(ctx, s, old)
	// The new holder acquired epoch 10 and has not written yet.
	if err := s.Advance(ctx, 6, 10); err != nil {
		t.Fatalf("Advance(6, 10): %v", err)
	}
	h.wantMax(ctx, s, 6, 10)
	zombie := h.effect(6, 4, "zombie")
	if _, ok := isStale(s.Apply(ctx, zombie)); !ok {
		t.Fatal("a write of the former holder after the take-over was not refused")
	}
	// Advancing to a lower epoch changes nothing.
	if err := s.Advance(ctx, 6, 8); err != nil {
		t.Fatalf("Advance(6, 8) below the maximum: %v, want nil", err)
	}
	h.wantMax(ctx, s, 6, 10)
	holder := h.effect(6, 10, "new-holder")
	h.mustApply(ctx, s, holder)
	if err := s.Advance(ctx, 6, 0); !errors.Is(err, leasehold.ErrBadStamp) {
		t.Fatalf("Advance(6, 0) = %v, want an error matching ErrBadStamp", err)
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
	if err := s.Advance(cctx, 7, 9); !errors.Is(err, context.Canceled) {
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
	if err := s.Advance(ctx, 10, 9); err != nil {
		t.Fatal(err)
	}
	s, err := h.inst.Reopen(ctx)
	if err != nil {
		t.Fatalf("Reopen: %v", err)
	}
	h.inst.Sink = s
	h.wantMax(ctx, s, 9, 7)
	h.wantMax(ctx, s, 10, 9)
	stale := h.effect(9, 6, "after-reopen-stale")
	if _, ok := isStale(s.Apply(ctx, stale)); !ok {
		t.Fatal("after reopen, a stale effect was not refused")
	}
	zombie := h.effect(10, 8, "after-reopen-zombie")
	if _, ok := isStale(s.Apply(ctx, zombie)); !ok {
		t.Fatal("after reopen, the advanced maximum did not refuse an older epoch")
	}
	h.wantApplied(ctx, []sink.Effect{a}, []sink.Effect{stale, zombie})
}

func testBatch(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	if err := s.Advance(ctx, 12, 5); err != nil {
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
	a, b := h.effect(11, 3, "batch-a"), h.effect(12, 5, "batch-b")
	h.mustApply(ctx, s, a, b)
	h.wantMax(ctx, s, 11, 3)
	h.wantMax(ctx, s, 12, 5)
	h.wantApplied(ctx, []sink.Effect{a, b}, []sink.Effect{ok1, stale, up, down})
}

func testDedupe(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	e := h.effect(14, 5, "once")
	h.mustApply(ctx, s, e)
	h.mustApply(ctx, s, e)
	// The same job re-run by the next holder emits the same key.
	rerun := e
	rerun.Stamp.Epoch = 6
	rerun.Data = []byte("second run")
	h.mustApply(ctx, s, rerun)
	h.wantMax(ctx, s, 14, 6)
	h.wantApplied(ctx, []sink.Effect{e}, nil)
	if n := len(h.rec.find(e.Stamp.Key, sink.Duplicate)); n != 2 {
		t.Fatalf("the observer saw %d Duplicate decisions for %s, want 2", n, e.Stamp.Key)
	}
	// A zombie repeating an applied key is still told it is stale.
	zombie := e
	zombie.Stamp.Epoch = 4
	if _, ok := isStale(s.Apply(ctx, zombie)); !ok {
		t.Fatal("a stale repeat of an applied key was not refused as stale")
	}
	if h.f.AtomicBatch {
		f := h.effect(14, 6, "in-batch")
		h.mustApply(ctx, s, f, f, rerun)
		h.wantApplied(ctx, []sink.Effect{e, f}, nil)
	}
}

// testHeaders feeds raw headers to a sink that reads stamps from them.
func testHeaders(t *testing.T, h *harness) {
	ctx := caseCtx(t)
	s := h.start(nil)
	if h.inst.ApplyHeader == nil {
		t.Fatal("sinktest: Features.Headers needs Instance.ApplyHeader")
	}
	stamp := leasehold.Stamp{Partition: 15, Epoch: 4, Key: h.scope + ".hdr-ok"}
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
		"conflicting epochs": func(m map[string][]string) {
			m["leasehold-epoch"] = []string{"9"}
		},
	}
	for what, mutate := range cases {
		st := stamp
		st.Key = h.scope + ".hdr-" + strings.ReplaceAll(what, " ", "-")
		m := stampHeader(st)
		mutate(m)
		err := h.inst.ApplyHeader(ctx, m, h.inst.Subject("hdr-bad"), []byte("bad"))
		if !errors.Is(err, leasehold.ErrBadStamp) || !strings.Contains(err.Error(), "Leasehold-") {
			t.Fatalf("%s: ApplyHeader = %v, want an error matching ErrBadStamp that names the header", what, err)
		}
	}
	h.wantMax(ctx, s, 15, 4)
	got := h.applied(ctx)
	if len(got[stamp.Key]) != 1 {
		t.Fatalf("the effect with lower-case headers was applied %d times, want once", len(got[stamp.Key]))
	}
	for k := range got {
		if strings.Contains(k, ".hdr-") && k != stamp.Key {
			t.Fatalf("an effect with bad headers was applied: %s", k)
		}
	}
}

func stampHeader(s leasehold.Stamp) map[string][]string {
	m := map[string][]string{}
	s.SetHeader(m)
	return m
}
