package leasehold_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

// FuzzStampHeadersLegacy feeds header maps of the legacy form as they
// arrive off the wire: any names (in any case), several values per name.
// A stamp is read only when every leasehold header has one canonical
// value, and what is read writes back to the same stamp; everything else
// is a StampError naming the header. A compact stamp among them, in any
// spelling, is refused: the map carries legacy headers.
func FuzzStampHeadersLegacy(f *testing.F) {
	f.Add("Leasehold-Partition", "3", "Leasehold-Epoch", "17", "Leasehold-Key", "k", "leasehold-epoch", "17")
	f.Add("LEASEHOLD-PARTITION", "0", "leasehold-epoch", "9223372036854775807", "Leasehold-Key", "a.b.c", "Leasehold-Worker", "w")
	f.Add("Leasehold-Partition", "65536", "Leasehold-Epoch", "1", "Leasehold-Key", "k", "X", "y")
	f.Add("Leasehold-Partition", "1", "Leasehold-Epoch", "2", "Leasehold-Key", "k", "leasehold-EPOCH", "3")
	f.Add("Leasehold-Partition", "1", "Leasehold-Epoch", "01", "Leasehold-Key", "k\x00", "Nats-Msg-Id", "k")
	f.Add("Leasehold-Partition", "3", "Leasehold-Epoch", "17", "Leasehold-Key", "k", "leasehold-stamp", "1 orders 3 17 a1b2 k")
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2, n3, v3, n4, v4 string) {
		h := map[string][]string{
			leasehold.HeaderScope:       {"orders"},
			leasehold.HeaderAcquisition: {"a1b2"},
		}
		for _, kv := range [][2]string{{n1, v1}, {n2, v2}, {n3, v3}, {n4, v4}} {
			h[kv[0]] = append(h[kv[0]], kv[1])
		}
		s, err := leasehold.StampFromHeader(h)
		if !stampRead(t, s, err) {
			return
		}
		for k := range h {
			if strings.EqualFold(k, leasehold.HeaderStamp) {
				t.Fatalf("read %+v from legacy headers beside %s", s, k)
			}
		}
		// Every spelling of the epoch header said the same canonical value.
		for k, vs := range h {
			if strings.EqualFold(k, leasehold.HeaderEpoch) {
				for _, v := range vs {
					if v != s.Epoch.String() {
						t.Fatalf("accepted epoch %d beside the spelling %q", s.Epoch, v)
					}
				}
			}
		}
		stampRoundTrip(t, s, leasehold.StampLegacy)
	})
}

// FuzzStampMetadata does the same for Watermill-style metadata.
func FuzzStampMetadata(f *testing.F) {
	f.Add("3", "17", "k", "leasehold-epoch", "17")
	f.Add("3", "17", "k", "LEASEHOLD-EPOCH", "18")
	f.Add("", "", "", "", "")
	f.Fuzz(func(t *testing.T, p, e, k, extraName, extraValue string) {
		md := map[string]string{
			leasehold.HeaderScope:       "orders",
			leasehold.HeaderAcquisition: "a1b2",
			leasehold.HeaderPartition:   p,
			leasehold.HeaderEpoch:       e,
			leasehold.HeaderKey:         k,
		}
		md[extraName] = extraValue
		s, err := leasehold.StampFromMetadata(md)
		if err != nil {
			if !errors.Is(err, leasehold.ErrBadStamp) || s != (leasehold.Stamp{}) {
				t.Fatalf("%+v, %v", s, err)
			}
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("read %+v, which does not validate: %v", s, err)
		}
		out := map[string]string{}
		s.SetMetadata(out)
		if back, err := leasehold.StampFromMetadata(out); err != nil || back != s {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, s)
		}
	})
}

// FuzzParseEpoch: an epoch has exactly one spelling.
func FuzzParseEpoch(f *testing.F) {
	for _, s := range []string{"1", "0", "007", "+1", "-1", "9223372036854775807", "9223372036854775808", " 1", "１"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		e, err := leasehold.ParseEpoch(s)
		if err != nil {
			if e != 0 || !strings.Contains(err.Error(), "epoch") {
				t.Fatalf("ParseEpoch(%q) = %d, %v", s, e, err)
			}
			return
		}
		if e == 0 || e > leasehold.MaxEpoch || e.String() != s {
			t.Fatalf("ParseEpoch(%q) = %d", s, e)
		}
	})
}

// FuzzJobMarkHeadersLegacy: legacy job headers are read only when every
// one has a single canonical value in its place, and what is read writes
// back the same.
func FuzzJobMarkHeadersLegacy(f *testing.F) {
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Effects", "3", "Leasehold-After", "5", "", "")
	f.Add("leasehold-job", "7", "LEASEHOLD-ATTEMPT", "2", "Leasehold-Abort", "1", "", "", "", "")
	f.Add("Leasehold-Job", "07", "Leasehold-Attempt", "1", "Leasehold-Effects", "0", "Leasehold-After", "7", "", "")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Abort", "1", "Leasehold-After", "1", "", "")
	f.Add("Leasehold-Job", "18446744073709551615", "Leasehold-Attempt", "9007199254740993", "Leasehold-Effects", "1048577", "X", "y", "", "")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Effects", "3", "Leasehold-After", "9", "Leasehold-Floor", "0")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Effects", "1", "Leasehold-After", "7", "leasehold-floor", "6")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Effects", "1", "Leasehold-After", "0", "Leasehold-Floor", "7")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Abort", "1", "Leasehold-Floor", "3", "", "")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Floor", "3", "Leasehold-Floor", "03", "", "")
	f.Add("Leasehold-Job", "7", "Leasehold-Attempt", "1", "Leasehold-Mark", "1 7 1", "", "", "", "")
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2, n3, v3, n4, v4, n5, v5 string) {
		h := map[string][]string{}
		for _, kv := range [][2]string{{n1, v1}, {n2, v2}, {n3, v3}, {n4, v4}, {n5, v5}} {
			h[kv[0]] = append(h[kv[0]], kv[1])
		}
		m, err := leasehold.JobMarkFromHeader(h)
		if !markRead(t, m, err) {
			return
		}
		if !m.Standalone() && (m.Attempt == 0 || m.Attempt > leasehold.MaxAttempt) {
			t.Fatalf("accepted attempt %d", m.Attempt)
		}
		compact, legacy := false, false
		for k := range h {
			switch {
			case strings.EqualFold(k, leasehold.HeaderMark):
				compact = true
			case isLegacyJobHeader(k):
				legacy = true
			}
		}
		if compact && legacy {
			t.Fatalf("accepted %+v from both forms: %v", m, h)
		}
		markRules(t, m)
		for k, vs := range h {
			var want string
			switch {
			case strings.EqualFold(k, leasehold.HeaderJob):
				want = strconv.FormatUint(m.Job, 10)
			case strings.EqualFold(k, leasehold.HeaderFloor):
				want = strconv.FormatUint(m.Floor, 10)
			default:
				continue
			}
			for _, v := range vs {
				if v != want {
					t.Fatalf("accepted %+v beside the spelling %s: %q", m, k, v)
				}
			}
		}
		out := map[string][]string{}
		m.SetHeader(out)
		markRoundTrip(t, m, out)
	})
}

func isLegacyJobHeader(k string) bool {
	for _, h := range []string{leasehold.HeaderJob, leasehold.HeaderAttempt, leasehold.HeaderEffects, leasehold.HeaderAfter, leasehold.HeaderAbort, leasehold.HeaderFloor} {
		if strings.EqualFold(k, h) {
			return true
		}
	}
	return false
}

// FuzzStampHeaders feeds a compact stamp (Leasehold-Stamp) as it arrives
// off the wire, under one or two spellings, beside another header of any
// name. A stamp is read only when every spelling carries one value, no
// legacy stamp header stands beside it, and the value is the stamp's one
// spelling: what is read formats back to exactly the value on the wire.
// Everything else is a StampError naming the header.
func FuzzStampHeaders(f *testing.F) {
	f.Add("1 orders 7 1796042013866141 a1b2c3d4e5f6a7b8 orders.7.123456.0 worker-3", "leasehold-stamp", "1 orders 7 1796042013866141 a1b2c3d4e5f6a7b8 orders.7.123456.0 worker-3", "X", "y")
	f.Add("1 orders 7 5 a1 k", "LEASEHOLD-STAMP", "1 orders 7 6 a1 k", "", "")
	f.Add("1 orders 7 5 a1 k", "", "", "Leasehold-Epoch", "5")
	f.Add("1 orders 7 5 a1 k", "", "", "leasehold-worker", "w")
	f.Add("1 orders 07 5 a1 k", "", "", "", "")
	f.Add("1 orders 7 5 a1 k  ", "", "", "Nats-Msg-Id", "k")
	f.Add("2 orders 7 5 a1 k", "", "", "", "")
	f.Add("1 a/b 0 9223372036854775807 A_-z k\x80 w", "", "", "", "")
	f.Fuzz(func(t *testing.T, v, name2, v2, extraName, extraValue string) {
		h := map[string][]string{leasehold.HeaderStamp: {v}}
		if name2 != "" {
			h[name2] = append(h[name2], v2)
		}
		h[extraName] = append(h[extraName], extraValue)
		s, err := leasehold.StampFromHeader(h)
		if !stampRead(t, s, err) {
			return
		}
		if len(v) > leasehold.MaxStampLen {
			t.Fatalf("read %+v from %d bytes", s, len(v))
		}
		for k, vs := range h {
			switch {
			case strings.EqualFold(k, leasehold.HeaderStamp):
				for _, x := range vs {
					if x != s.Compact() {
						t.Fatalf("read %+v beside the spelling %q (its one is %q)", s, x, s.Compact())
					}
				}
			case leasehold.IsStampHeader(k) && !isLegacyJobHeader(k) && !strings.EqualFold(k, leasehold.HeaderMark):
				t.Fatalf("read %+v beside the legacy header %s", s, k)
			}
		}
		stampRoundTrip(t, s, leasehold.StampCompact)
		stampRoundTrip(t, s, leasehold.StampLegacy)
	})
}

// FuzzJobMarkHeaders: a compact job mark (Leasehold-Mark) is read only
// when it is the mark's one spelling, alone in its form, and within the
// rules of the legacy headers; what is read formats back to the value.
func FuzzJobMarkHeaders(f *testing.F) {
	for _, v := range []string{"1 7 1", "1 7 2 abort", "1 7 1 3 5", "1 7 1 3 9 0", "1 7 1 3 9 6", "1 7 1 1 7",
		"1 7 1 3 9", "1 7 1 1 5 7", "1 07 1", "1 7 1 abort 3", "1 9223372036854775808 9007199254740992 1048576 9223372036854775807 9223372036854775807"} {
		f.Add(v, "", "")
	}
	f.Add("1 7 1 1 5", "Leasehold-Floor", "3")
	f.Add("1 7 1", "leasehold-mark", "1 7 1")
	f.Add("1 7 1", "LEASEHOLD-MARK", "1 7 2")
	f.Fuzz(func(t *testing.T, v, name2, v2 string) {
		h := map[string][]string{leasehold.HeaderMark: {v}}
		h[name2] = append(h[name2], v2)
		m, err := leasehold.JobMarkFromHeader(h)
		if !markRead(t, m, err) {
			return
		}
		if m.Standalone() || m.Attempt == 0 || m.Attempt > leasehold.MaxAttempt || len(v) > leasehold.MaxMarkLen {
			t.Fatalf("accepted %+v from %q", m, v)
		}
		markRules(t, m)
		for k, vs := range h {
			switch {
			case strings.EqualFold(k, leasehold.HeaderMark):
				for _, x := range vs {
					if x != m.Compact() {
						t.Fatalf("accepted %+v beside the spelling %q (its one is %q)", m, x, m.Compact())
					}
				}
			case isLegacyJobHeader(k):
				t.Fatalf("accepted %+v beside the legacy header %s", m, k)
			}
		}
		out := map[string][]string{leasehold.HeaderStamp: {"1 orders 7 5 a1 k"}}
		m.SetHeader(out)
		markRoundTrip(t, m, out)
	})
}

// stampRead checks what StampFromHeader returned: an error is a
// StampError matching ErrBadStamp that names its header and comes with no
// partial stamp (false); a stamp read validates (true).
func stampRead(t *testing.T, s leasehold.Stamp, err error) bool {
	t.Helper()
	if err != nil {
		var se *leasehold.StampError
		if !errors.As(err, &se) || !errors.Is(err, leasehold.ErrBadStamp) {
			t.Fatalf("error %v is not a StampError matching ErrBadStamp", err)
		}
		if s != (leasehold.Stamp{}) {
			t.Fatalf("error %v came with a partial stamp %+v", err, s)
		}
		if !strings.Contains(err.Error(), se.Header) {
			t.Fatalf("error %q does not name header %s", err, se.Header)
		}
		return false
	}
	if err := s.Validate(); err != nil {
		t.Fatalf("read %+v, which does not validate: %v", s, err)
	}
	return true
}

// stampRoundTrip writes s in form f and reads it back.
func stampRoundTrip(t *testing.T, s leasehold.Stamp, f leasehold.StampFormat) {
	t.Helper()
	out := map[string][]string{}
	s.SetHeaderAs(out, f)
	if back, err := leasehold.StampFromHeader(out); err != nil || back != s {
		t.Fatalf("round trip (form %v): %+v, %v; want %+v", f, back, err, s)
	}
}

// markRead is stampRead for JobMarkFromHeader: an error is a
// JobMarkError matching ErrBadJobMark that names its header and comes
// with no partial mark (false).
func markRead(t *testing.T, m leasehold.JobMark, err error) bool {
	t.Helper()
	if err == nil {
		return true
	}
	var je *leasehold.JobMarkError
	if !errors.As(err, &je) || !errors.Is(err, leasehold.ErrBadJobMark) {
		t.Fatalf("error %v is not a JobMarkError matching ErrBadJobMark", err)
	}
	if m != (leasehold.JobMark{}) {
		t.Fatalf("error %v came with a partial mark %+v", err, m)
	}
	if !strings.Contains(err.Error(), je.Header) {
		t.Fatalf("error %q does not name header %s", err, je.Header)
	}
	return false
}

// markRules checks the rules a mark read in either form keeps: a final
// has effects within the bound, an After that is not the job and no
// abort; only a final says it completes out of order, and then its floor
// is below it; without one, After is below the job.
func markRules(t *testing.T, m leasehold.JobMark) {
	t.Helper()
	if m.Final() && (m.Effects > leasehold.MaxJobEffects || m.After == m.Job || m.Abort) {
		t.Fatalf("accepted final %+v", m)
	}
	if m.Floored != m.Floors() || (m.Floored && m.Floor >= m.Job) || (!m.Floored && (m.Floor != 0 || m.After > m.Job)) {
		t.Fatalf("accepted %+v", m)
	}
}

// markRoundTrip reads back the headers out that m was written to.
func markRoundTrip(t *testing.T, m leasehold.JobMark, out map[string][]string) {
	t.Helper()
	if back, err := leasehold.JobMarkFromHeader(out); err != nil || back != m {
		t.Fatalf("round trip: %+v, %v; want %+v", back, err, m)
	}
}

// FuzzUnpack feeds packed bodies as they arrive off the wire, with any
// count. What is read keeps every rule of the form (see
// leasehold.HeaderPack): exactly the counted entries, valid distinct keys,
// header names that are tokens and none of leasehold's or the server's; and
// written again it takes as many bytes as it came in, and reads back the
// same. Everything else is an error matching ErrBadPack.
func FuzzUnpack(f *testing.F) {
	add := func(n int, es ...leasehold.PackedEffect) {
		var body []byte
		for _, e := range es {
			body = leasehold.AppendPacked(body, e)
		}
		f.Add(body, n)
	}
	tp := map[string][]string{"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	add(2, leasehold.PackedEffect{Key: "orders.3.17.0", Header: tp, Data: []byte("a")}, leasehold.PackedEffect{Key: "orders.3.17.1", Data: []byte("b")})
	add(3, leasehold.PackedEffect{Key: "a"}, leasehold.PackedEffect{Key: "b", Header: map[string][]string{"X": {"1", "2"}, "y": {""}}}, leasehold.PackedEffect{Key: "c", Data: make([]byte, 200)})
	add(2, leasehold.PackedEffect{Key: "a"}, leasehold.PackedEffect{Key: "a"})
	add(2, leasehold.PackedEffect{Key: "a", Header: map[string][]string{"leasehold-stamp": {"1 orders 3 5 a1 a"}}}, leasehold.PackedEffect{Key: "b"})
	add(2, leasehold.PackedEffect{Key: "a", Header: map[string][]string{"Nats-Msg-Id": {"x"}}}, leasehold.PackedEffect{Key: "b"})
	add(2, leasehold.PackedEffect{Key: "a", Header: map[string][]string{"Leasehold-Pack": {"1 2"}}}, leasehold.PackedEffect{Key: "b"})
	add(3, leasehold.PackedEffect{Key: "a"}, leasehold.PackedEffect{Key: "b"})
	add(1, leasehold.PackedEffect{Key: "a"})
	f.Add([]byte{1, 'a', 0, 0, 1, 'b', 0, 0, 0}, 2)
	f.Add([]byte{1, 'a', 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0}, 2)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 'a', 0, 0, 1, 'b', 0, 0}, 2)
	f.Add([]byte{1, 'a', 1, 1, ' ', 0, 0, 1, 'b', 0, 0}, 2)
	f.Fuzz(func(t *testing.T, body []byte, n int) {
		es, err := leasehold.Unpack(body, n)
		if err != nil {
			if !errors.Is(err, leasehold.ErrBadPack) || es != nil {
				t.Fatalf("error %v (matches ErrBadPack: %t) came with %d entries", err, errors.Is(err, leasehold.ErrBadPack), len(es))
			}
			return
		}
		if len(es) != n || n < 2 || n > leasehold.MaxPackEffects {
			t.Fatalf("read %d entries for a count of %d", len(es), n)
		}
		keys := map[string]bool{}
		size := 0
		for i, e := range es {
			if keys[e.Key] {
				t.Fatalf("entry %d repeats key %q", i, e.Key)
			}
			keys[e.Key] = true
			if (leasehold.Stamp{Scope: "s", Epoch: 1, Acquisition: "a", Key: e.Key}).Validate() != nil {
				t.Fatalf("entry %d: key %q is not a valid idempotency key", i, e.Key)
			}
			for k := range e.Header {
				if k == "" || strings.ContainsAny(k, " :\r\n\x00") || leasehold.IsStampHeader(k) ||
					strings.EqualFold(k, leasehold.HeaderPack) || strings.EqualFold(k, leasehold.HeaderBarrier) ||
					(len(k) >= 5 && strings.EqualFold(k[:5], "Nats-")) {
					t.Fatalf("entry %d: header %q accepted", i, k)
				}
			}
			size += leasehold.PackedSize(e)
		}
		if size != len(body) {
			t.Fatalf("entries take %d bytes written again; they came in %d", size, len(body))
		}
		var again []byte
		for _, e := range es {
			again = leasehold.AppendPacked(again, e)
		}
		back, err := leasehold.Unpack(again, n)
		if err != nil {
			t.Fatalf("written again: %v", err)
		}
		for i := range es {
			if back[i].Key != es[i].Key || string(back[i].Data) != string(es[i].Data) || len(back[i].Header) != len(es[i].Header) {
				t.Fatalf("entry %d read back as %+v; was %+v", i, back[i], es[i])
			}
			for k, vs := range es[i].Header {
				if strings.Join(back[i].Header[k], "\x00") != strings.Join(vs, "\x00") || len(back[i].Header[k]) != len(vs) {
					t.Fatalf("entry %d header %s read back as %q; was %q", i, k, back[i].Header[k], vs)
				}
			}
		}
	})
}
