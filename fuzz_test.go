package leasehold_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

// FuzzStampHeaders feeds header maps as they arrive off the wire: any
// names (in any case), several values per name. A stamp is read only when
// every leasehold header has one canonical value, and what is read writes
// back to the same stamp; everything else is a StampError naming the
// header.
func FuzzStampHeaders(f *testing.F) {
	f.Add("Leasehold-Partition", "3", "Leasehold-Epoch", "17", "Leasehold-Key", "k", "leasehold-epoch", "17")
	f.Add("LEASEHOLD-PARTITION", "0", "leasehold-epoch", "9223372036854775807", "Leasehold-Key", "a.b.c", "Leasehold-Worker", "w")
	f.Add("Leasehold-Partition", "65536", "Leasehold-Epoch", "1", "Leasehold-Key", "k", "X", "y")
	f.Add("Leasehold-Partition", "1", "Leasehold-Epoch", "2", "Leasehold-Key", "k", "leasehold-EPOCH", "3")
	f.Add("Leasehold-Partition", "1", "Leasehold-Epoch", "01", "Leasehold-Key", "k\x00", "Nats-Msg-Id", "k")
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2, n3, v3, n4, v4 string) {
		h := map[string][]string{
			leasehold.HeaderScope:       {"orders"},
			leasehold.HeaderAcquisition: {"a1b2"},
		}
		for _, kv := range [][2]string{{n1, v1}, {n2, v2}, {n3, v3}, {n4, v4}} {
			h[kv[0]] = append(h[kv[0]], kv[1])
		}
		s, err := leasehold.StampFromHeader(h)
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
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("read %+v, which does not validate: %v", s, err)
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
		out := map[string][]string{}
		s.SetHeader(out)
		if back, err := leasehold.StampFromHeader(out); err != nil || back != s {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, s)
		}
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

// FuzzJobMarkHeaders: job headers are read only when every one has a single
// canonical value in its place, and what is read writes back the same.
func FuzzJobMarkHeaders(f *testing.F) {
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
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2, n3, v3, n4, v4, n5, v5 string) {
		h := map[string][]string{}
		for _, kv := range [][2]string{{n1, v1}, {n2, v2}, {n3, v3}, {n4, v4}, {n5, v5}} {
			h[kv[0]] = append(h[kv[0]], kv[1])
		}
		m, err := leasehold.JobMarkFromHeader(h)
		if err != nil {
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
			return
		}
		if !m.Standalone() && (m.Attempt == 0 || m.Attempt > leasehold.MaxAttempt) {
			t.Fatalf("accepted attempt %d", m.Attempt)
		}
		if m.Final() && (m.Effects > leasehold.MaxJobEffects || m.After == m.Job || m.Abort) {
			t.Fatalf("accepted final %+v", m)
		}
		// Only a final says it completes out of order, and then its floor
		// is below it; without one, After is below the job.
		if m.Floored != m.Floors() || (m.Floored && m.Floor >= m.Job) || (!m.Floored && (m.Floor != 0 || m.After > m.Job)) {
			t.Fatalf("accepted %+v", m)
		}
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
		if back, err := leasehold.JobMarkFromHeader(out); err != nil || back != m {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, m)
		}
	})
}
