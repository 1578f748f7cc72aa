package leasehold_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

var wireStamp = leasehold.Stamp{Scope: "orders", Partition: 7, Epoch: 1796042013866141,
	Acquisition: "a1b2c3d4e5f6a7b8", Key: "orders.7.123456.0", Worker: "worker-3"}

func TestStampCompactForm(t *testing.T) {
	if got, want := wireStamp.Compact(), "1 orders 7 1796042013866141 a1b2c3d4e5f6a7b8 orders.7.123456.0 worker-3"; got != want {
		t.Fatalf("Compact() = %q, want %q", got, want)
	}
	h := map[string][]string{}
	wireStamp.SetHeaderAs(h, leasehold.StampCompact)
	if len(h) != 1 {
		t.Fatalf("the compact form wrote %d headers: %v", len(h), h)
	}
	got, err := leasehold.StampFromHeader(h)
	if err != nil || got != wireStamp {
		t.Fatalf("read back %+v, %v", got, err)
	}
	// Lower-cased by a proxy, and given twice with one value: the same.
	h = map[string][]string{"leasehold-stamp": {wireStamp.Compact(), wireStamp.Compact()}}
	if got, err := leasehold.StampFromHeader(h); err != nil || got != wireStamp {
		t.Fatalf("lower case: %+v, %v", got, err)
	}
	// A worker that cannot be a field is left off: it is informative.
	s := wireStamp
	s.Worker = "a worker"
	if got, _ := leasehold.ParseStamp(s.Compact()); got.Worker != "" || got.Key != s.Key {
		t.Fatalf("a worker with a space: read back %+v", got)
	}
	s.Worker = ""
	if got, err := leasehold.ParseStamp(s.Compact()); err != nil || got != s {
		t.Fatalf("no worker: %+v, %v", got, err)
	}
}

// TestStampCompactStrict: one spelling per stamp, everything else refused
// with a StampError naming Leasehold-Stamp.
func TestStampCompactStrict(t *testing.T) {
	long := strings.Repeat("k", leasehold.MaxKeyLen)
	for name, v := range map[string]string{
		"empty":              "",
		"version 2":          "2 orders 7 5 a1 k",
		"version 01":         "01 orders 7 5 a1 k",
		"no version":         "orders 7 5 a1 k",
		"leading space":      " 1 orders 7 5 a1 k",
		"trailing space":     "1 orders 7 5 a1 k ",
		"two spaces":         "1 orders  7 5 a1 k",
		"tab":                "1 orders\t7 5 a1 k",
		"too few":            "1 orders 7 5 a1",
		"too many":           "1 orders 7 5 a1 k w extra",
		"padded partition":   "1 orders 07 5 a1 k",
		"partition too big":  "1 orders 65536 5 a1 k",
		"padded epoch":       "1 orders 7 05 a1 k",
		"signed epoch":       "1 orders 7 +5 a1 k",
		"zero epoch":         "1 orders 7 0 a1 k",
		"epoch too big":      "1 orders 7 9223372036854775808 a1 k",
		"bad acquisition":    "1 orders 7 5 a.1 k",
		"control in key":     "1 orders 7 5 a1 k\x00",
		"key too long":       "1 orders 7 5 a1 " + long + "k",
		"worker too long":    "1 orders 7 5 a1 k " + strings.Repeat("w", leasehold.MaxWorkerLen+1),
		"non-ASCII worker":   "1 orders 7 5 a1 k wörker",
		"too long":           "1 orders 7 5 a1 " + strings.Repeat("k", leasehold.MaxStampLen),
		"non-ASCII in scope": "1 ordérs 7 5 a1 k",
	} {
		t.Run(name, func(t *testing.T) {
			s, err := leasehold.StampFromHeader(map[string][]string{leasehold.HeaderStamp: {v}})
			var se *leasehold.StampError
			if !errors.As(err, &se) || se.Header != leasehold.HeaderStamp || !errors.Is(err, leasehold.ErrBadStamp) || s != (leasehold.Stamp{}) {
				t.Fatalf("read %q as %+v, %v", v, s, err)
			}
		})
	}
}

// TestStampTwoForms: a message that carries the stamp in both forms is
// refused, even when they agree, so that no two readers can take it for
// two stamps; so is the compact header given twice with two values.
func TestStampTwoForms(t *testing.T) {
	for _, legacy := range []string{leasehold.HeaderScope, leasehold.HeaderPartition, leasehold.HeaderEpoch,
		leasehold.HeaderAcquisition, leasehold.HeaderKey, leasehold.HeaderWorker, "leasehold-epoch"} {
		h := map[string][]string{}
		wireStamp.SetHeader(h)
		h["LEASEHOLD-STAMP"] = []string{wireStamp.Compact()}
		for k := range h {
			if !strings.EqualFold(k, legacy) && !strings.EqualFold(k, leasehold.HeaderStamp) {
				delete(h, k)
			}
		}
		h[legacy] = []string{"9"}
		if s, err := leasehold.StampFromHeader(h); !errors.Is(err, leasehold.ErrBadStamp) {
			t.Errorf("%s beside %s: read %+v, %v", legacy, leasehold.HeaderStamp, s, err)
		}
		md := map[string]string{legacy: "9", leasehold.HeaderStamp: wireStamp.Compact()}
		if s, err := leasehold.StampFromMetadata(md); !errors.Is(err, leasehold.ErrBadStamp) {
			t.Errorf("metadata %s beside %s: read %+v, %v", legacy, leasehold.HeaderStamp, s, err)
		}
	}
	// Whole stamps in both forms: agreeing, and a forger's two epochs,
	// one per form, for readers that would prefer one form.
	later := wireStamp
	later.Epoch++
	for _, compact := range []leasehold.Stamp{wireStamp, later} {
		h := map[string][]string{}
		wireStamp.SetHeader(h)
		h[leasehold.HeaderStamp] = []string{compact.Compact()}
		if s, err := leasehold.StampFromHeader(h); !errors.Is(err, leasehold.ErrBadStamp) {
			t.Errorf("a whole stamp in each form, epochs %d and %d: read %+v, %v", wireStamp.Epoch, compact.Epoch, s, err)
		}
	}
	h := map[string][]string{leasehold.HeaderStamp: {wireStamp.Compact()}, "leasehold-stamp": {later.Compact()}}
	if s, err := leasehold.StampFromHeader(h); !errors.Is(err, leasehold.ErrBadStamp) {
		t.Fatalf("two compact stamps: read %+v, %v", s, err)
	}
}

// TestStampWritersReplaceTheOtherForm: each writer removes the other
// form, in any spelling, so that rewriting a stamp (a sink's dead letter,
// a replay) never leaves a message with both.
func TestStampWritersReplaceTheOtherForm(t *testing.T) {
	h := map[string][]string{"leasehold-epoch": {"3"}, "X-Other": {"x"}}
	wireStamp.SetHeader(h)
	wireStamp.SetHeaderAs(h, leasehold.StampCompact)
	if len(h) != 2 || h[leasehold.HeaderStamp] == nil {
		t.Fatalf("compact over legacy: %v", h)
	}
	h["leasehold-STAMP"] = h[leasehold.HeaderStamp]
	wireStamp.SetHeaderAs(h, leasehold.StampLegacy)
	for k := range h {
		if strings.EqualFold(k, leasehold.HeaderStamp) {
			t.Fatalf("legacy over compact left %s: %v", k, h)
		}
	}
	if s, err := leasehold.StampFromHeader(h); err != nil || s != wireStamp {
		t.Fatalf("legacy over compact: %+v, %v", s, err)
	}
	md := map[string]string{leasehold.HeaderStamp: "1 x 1 1 a k"}
	wireStamp.SetMetadata(md)
	if s, err := leasehold.StampFromMetadata(md); err != nil || s != wireStamp {
		t.Fatalf("metadata over compact: %+v, %v", s, err)
	}
}

func TestJobMarkCompactForm(t *testing.T) {
	for want, m := range map[string]leasehold.JobMark{
		"1 7 1":                             {Job: 7, Attempt: 1},
		"1 7 2 abort":                       {Job: 7, Attempt: 2, Abort: true},
		"1 7 1 3 5":                         {Job: 7, Attempt: 1, Effects: 3, After: 5},
		"1 7 1 1 0":                         {Job: 7, Attempt: 1, Effects: 1},
		"1 7 1 3 9 0":                       {Job: 7, Attempt: 1, Effects: 3, After: 9, Floored: true},
		"1 7 1 3 9 6":                       {Job: 7, Attempt: 1, Effects: 3, After: 9, Floor: 6, Floored: true},
		"1 9223372036854775808 1 1048576 0": {Job: 1 << 63, Attempt: 1, Effects: leasehold.MaxJobEffects},
	} {
		if got := m.Compact(); got != want {
			t.Errorf("%+v: Compact() = %q, want %q", m, got, want)
		}
		h := map[string][]string{}
		wireStamp.SetHeaderAs(h, leasehold.StampCompact)
		m.SetHeader(h) // follows the stamp's form
		if len(h) != 2 || h[leasehold.HeaderMark][0] != want {
			t.Errorf("%+v beside a compact stamp wrote %v", m, h)
		}
		if got, err := leasehold.JobMarkFromHeader(h); err != nil || got != m {
			t.Errorf("%q read back as %+v, %v", want, got, err)
		}
		// Beside a legacy stamp, the legacy form, and the compact one gone.
		wireStamp.SetHeader(h)
		m.SetHeader(h)
		if _, ok := h[leasehold.HeaderMark]; ok || h[leasehold.HeaderJob] == nil {
			t.Errorf("%+v beside a legacy stamp wrote %v", m, h)
		}
		if got, err := leasehold.JobMarkFromHeader(h); err != nil || got != m {
			t.Errorf("legacy %+v read back as %+v, %v", m, got, err)
		}
	}
	h := map[string][]string{leasehold.HeaderMark: {"1 7 1"}}
	leasehold.JobMark{}.SetHeaderAs(h, leasehold.StampCompact)
	if len(h) != 0 {
		t.Fatalf("a standalone mark left %v", h)
	}
}

func TestJobMarkCompactStrict(t *testing.T) {
	for name, v := range map[string]string{
		"empty":              "",
		"version 2":          "2 7 1",
		"job only":           "1 7",
		"zero job":           "1 0 1",
		"padded job":         "1 07 1",
		"zero attempt":       "1 7 0",
		"attempt too big":    "1 7 9007199254740993",
		"abort spelled 1":    "1 7 1 1",
		"abort with count":   "1 7 1 abort 5",
		"ABORT":              "1 7 1 ABORT",
		"zero effects":       "1 7 1 0 5",
		"effects too many":   "1 7 1 1048577 5",
		"after is the job":   "1 7 1 1 7",
		"after beyond":       "1 7 1 1 9",
		"floor at the job":   "1 7 1 1 9 7",
		"after is job, fl":   "1 7 1 1 7 6",
		"seven fields":       "1 7 1 1 5 3 2",
		"two spaces":         "1 7  1",
		"trailing space":     "1 7 1 ",
		"signed":             "1 +7 1",
		"job too big":        "1 9223372036854775809 1",
		"too long":           "1 7 1 " + strings.Repeat("1", leasehold.MaxMarkLen),
		"non-digit attempt":  "1 7 x",
		"non-digit in floor": "1 7 1 1 5 0x1",
	} {
		t.Run(name, func(t *testing.T) {
			m, err := leasehold.JobMarkFromHeader(map[string][]string{leasehold.HeaderMark: {v}})
			var je *leasehold.JobMarkError
			if !errors.As(err, &je) || je.Header != leasehold.HeaderMark || !errors.Is(err, leasehold.ErrBadJobMark) || m != (leasehold.JobMark{}) {
				t.Fatalf("read %q as %+v, %v", v, m, err)
			}
		})
	}
}

// TestJobMarkTwoForms: the mark in both forms is refused, whatever they
// say; so is an abort in the legacy form beside a compact final.
func TestJobMarkTwoForms(t *testing.T) {
	for _, legacy := range []string{leasehold.HeaderJob, leasehold.HeaderAttempt, leasehold.HeaderEffects,
		leasehold.HeaderAfter, leasehold.HeaderAbort, leasehold.HeaderFloor, "leasehold-abort"} {
		h := map[string][]string{leasehold.HeaderMark: {"1 7 1 1 5"}, legacy: {"1"}}
		if m, err := leasehold.JobMarkFromHeader(h); !errors.Is(err, leasehold.ErrBadJobMark) {
			t.Errorf("%s beside %s: read %+v, %v", legacy, leasehold.HeaderMark, m, err)
		}
		md := map[string]string{"leasehold-mark": "1 7 1 abort", legacy: "1"}
		if m, err := leasehold.JobMarkFromMetadata(md); !errors.Is(err, leasehold.ErrBadJobMark) {
			t.Errorf("metadata %s beside %s: read %+v, %v", legacy, leasehold.HeaderMark, m, err)
		}
	}
	whole := map[string][]string{leasehold.HeaderMark: {"1 7 1 1 5"}}
	leasehold.JobMark{Job: 7, Attempt: 1, Effects: 1, After: 5}.SetHeaderAs(whole, leasehold.StampLegacy)
	whole[leasehold.HeaderMark] = []string{"1 7 1 1 5"}
	if m, err := leasehold.JobMarkFromHeader(whole); !errors.Is(err, leasehold.ErrBadJobMark) {
		t.Errorf("a whole mark in each form: read %+v, %v", m, err)
	}
	h := map[string][]string{leasehold.HeaderMark: {"1 7 1"}, "LEASEHOLD-MARK": {"1 7 2"}}
	if m, err := leasehold.JobMarkFromHeader(h); !errors.Is(err, leasehold.ErrBadJobMark) {
		t.Fatalf("two compact marks: read %+v, %v", m, err)
	}
}

// TestStampParseAllocations: reading the compact form allocates nothing:
// the stamp's strings are parts of the header's value.
func TestStampParseAllocations(t *testing.T) {
	h := map[string][]string{}
	wireStamp.SetHeaderAs(h, leasehold.StampCompact)
	leasehold.JobMark{Job: 123456, Attempt: 1, Effects: 1, After: 123455}.SetHeader(h)
	h["Nats-Msg-Id"] = []string{"x"}
	h["Traceparent"] = []string{"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	n := testing.AllocsPerRun(100, func() {
		if _, err := leasehold.StampFromHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := leasehold.JobMarkFromHeader(h); err != nil {
			t.Fatal(err)
		}
	})
	if n != 0 {
		t.Fatalf("reading a compact stamp and mark took %v allocations", n)
	}
}

func TestStampFormat(t *testing.T) {
	for _, f := range []leasehold.StampFormat{leasehold.StampCompact, leasehold.StampLegacy} {
		if got, err := leasehold.ParseStampFormat(f.String()); err != nil || got != f || f.Validate() != nil {
			t.Errorf("%v: %v, %v", f, got, err)
		}
	}
	if _, err := leasehold.ParseStampFormat("headers"); err == nil {
		t.Error(`"headers" parsed`)
	}
	if err := leasehold.StampFormat(2).Validate(); err == nil {
		t.Error("format 2 validated")
	}
	if !leasehold.IsStampHeader("leasehold-mark") || !leasehold.IsStampHeader("Leasehold-Floor") || leasehold.IsStampHeader("Leasehold-Barrier") {
		t.Error("IsStampHeader")
	}
}
