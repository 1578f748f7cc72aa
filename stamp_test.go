package leasehold_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

func TestParseEpochStrict(t *testing.T) {
	good := map[string]leasehold.Epoch{
		"1":                   1,
		"42":                  42,
		"9223372036854775807": leasehold.MaxEpoch,
	}
	for in, want := range good {
		got, err := leasehold.ParseEpoch(in)
		if err != nil || got != want {
			t.Errorf("ParseEpoch(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	bad := []string{
		"", " ", "0", "00", "01", "+1", "-1", " 1", "1 ", "1\n", "1.0", "1e3", "0x10",
		"9223372036854775808",  // MaxInt64 + 1: not a PostgreSQL bigint
		"18446744073709551615", // MaxUint64
		"18446744073709551616", // overflows uint64
		"１",                    // a full-width digit
	}
	for _, in := range bad {
		got, err := leasehold.ParseEpoch(in)
		if err == nil {
			t.Errorf("ParseEpoch(%q) = %d, nil; want an error", in, got)
		}
		if got != 0 {
			t.Errorf("ParseEpoch(%q) returned %d beside its error", in, got)
		}
	}
}

func TestParsePartitionStrict(t *testing.T) {
	if p, err := leasehold.ParsePartition("0"); err != nil || p != 0 {
		t.Fatalf("ParsePartition(0) = %d, %v", p, err)
	}
	if p, err := leasehold.ParsePartition("65535"); err != nil || p != 65535 {
		t.Fatalf("ParsePartition(65535) = %d, %v", p, err)
	}
	for _, in := range []string{"", "-0", "+3", "03", "65536", "3 ", "x"} {
		if _, err := leasehold.ParsePartition(in); err == nil {
			t.Errorf("ParsePartition(%q): want an error", in)
		}
	}
}

func TestStampRoundTrip(t *testing.T) {
	s := leasehold.Stamp{Scope: "orders", Partition: 7, Epoch: 1234, Acquisition: "9f3a", Key: leasehold.EffectKey("orders", 7, 99, 2), Worker: "w-1"}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	h := map[string][]string{}
	s.SetHeader(h)
	got, err := leasehold.StampFromHeader(h)
	if err != nil || got != s {
		t.Fatalf("round trip: got %+v, %v; want %+v", got, err, s)
	}
	md := map[string]string{}
	s.SetMetadata(md)
	if got, err := leasehold.StampFromMetadata(md); err != nil || got != s {
		t.Fatalf("metadata round trip: got %+v, %v", got, err)
	}
	if s.Key != "orders.7.99.2" {
		t.Fatalf("EffectKey = %q", s.Key)
	}
}

func TestStampMetadataConflictAcrossCase(t *testing.T) {
	md := map[string]string{}
	leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 4, Acquisition: "a", Key: "k"}.SetMetadata(md)
	md["leasehold-epoch"] = "9"
	if _, err := leasehold.StampFromMetadata(md); !errors.Is(err, leasehold.ErrBadStamp) {
		t.Fatalf("two spellings of the epoch with different values: %v, want ErrBadStamp", err)
	}
}

func TestStampHeaderNamesIgnoreCase(t *testing.T) {
	h := map[string][]string{
		"leasehold-scope":       {"orders"},
		"leasehold-partition":   {"3"},
		"LEASEHOLD-EPOCH":       {"17"},
		"leasehold-acquisition": {"a1"},
		"Leasehold-Key":         {"k"},
	}
	s, err := leasehold.StampFromHeader(h)
	if err != nil {
		t.Fatal(err)
	}
	if s.Scope != "orders" || s.Partition != 3 || s.Epoch != 17 || s.Acquisition != "a1" || s.Key != "k" {
		t.Fatalf("got %+v", s)
	}
}

func TestStampBadHeaders(t *testing.T) {
	valid := func() map[string][]string {
		return map[string][]string{
			leasehold.HeaderScope:       {"orders"},
			leasehold.HeaderPartition:   {"3"},
			leasehold.HeaderEpoch:       {"17"},
			leasehold.HeaderAcquisition: {"a1"},
			leasehold.HeaderKey:         {"k"},
		}
	}
	cases := []struct {
		name   string
		mutate func(h map[string][]string)
		header string
	}{
		{"missing epoch", func(h map[string][]string) { delete(h, leasehold.HeaderEpoch) }, leasehold.HeaderEpoch},
		{"empty epoch", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{""} }, leasehold.HeaderEpoch},
		{"no values", func(h map[string][]string) { h[leasehold.HeaderEpoch] = nil }, leasehold.HeaderEpoch},
		{"signed epoch", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{"-17"} }, leasehold.HeaderEpoch},
		{"padded epoch", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{"017"} }, leasehold.HeaderEpoch},
		{"spaced epoch", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{" 17"} }, leasehold.HeaderEpoch},
		{"huge epoch", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{"99999999999999999999"} }, leasehold.HeaderEpoch},
		{"zero epoch", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{"0"} }, leasehold.HeaderEpoch},
		{"two epochs", func(h map[string][]string) { h[leasehold.HeaderEpoch] = []string{"17", "18"} }, leasehold.HeaderEpoch},
		{"epoch in two cases", func(h map[string][]string) { h["leasehold-epoch"] = []string{"99"} }, leasehold.HeaderEpoch},
		{"missing partition", func(h map[string][]string) { delete(h, leasehold.HeaderPartition) }, leasehold.HeaderPartition},
		{"garbled partition", func(h map[string][]string) { h[leasehold.HeaderPartition] = []string{"3x"} }, leasehold.HeaderPartition},
		{"missing scope", func(h map[string][]string) { delete(h, leasehold.HeaderScope) }, leasehold.HeaderScope},
		{"empty scope", func(h map[string][]string) { h[leasehold.HeaderScope] = []string{""} }, leasehold.HeaderScope},
		{"scope with a space", func(h map[string][]string) { h[leasehold.HeaderScope] = []string{"a b"} }, leasehold.HeaderScope},
		{"scope too long", func(h map[string][]string) { h[leasehold.HeaderScope] = []string{strings.Repeat("s", 257)} }, leasehold.HeaderScope},
		{"two scopes", func(h map[string][]string) { h["leasehold-scope"] = []string{"payments"} }, leasehold.HeaderScope},
		{"missing acquisition", func(h map[string][]string) { delete(h, leasehold.HeaderAcquisition) }, leasehold.HeaderAcquisition},
		{"garbled acquisition", func(h map[string][]string) { h[leasehold.HeaderAcquisition] = []string{"a.b"} }, leasehold.HeaderAcquisition},
		{"missing key", func(h map[string][]string) { delete(h, leasehold.HeaderKey) }, leasehold.HeaderKey},
		{"key with a newline", func(h map[string][]string) { h[leasehold.HeaderKey] = []string{"a\nb"} }, leasehold.HeaderKey},
		{"key too long", func(h map[string][]string) { h[leasehold.HeaderKey] = []string{strings.Repeat("k", 300)} }, leasehold.HeaderKey},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := valid()
			c.mutate(h)
			s, err := leasehold.StampFromHeader(h)
			if err == nil {
				t.Fatalf("got %+v, want an error", s)
			}
			if s != (leasehold.Stamp{}) {
				t.Fatalf("a partial stamp %+v came back with the error", s)
			}
			var se *leasehold.StampError
			if !errors.As(err, &se) || se.Header != c.header || !errors.Is(err, leasehold.ErrBadStamp) {
				t.Fatalf("error %v: want a StampError about %s matching ErrBadStamp", err, c.header)
			}
			if !strings.Contains(err.Error(), c.header) || !strings.Contains(err.Error(), "publish effects through") {
				t.Fatalf("error %q does not say which header or what to do", err)
			}
		})
	}
}

func TestStaleEpochError(t *testing.T) {
	err := fmt.Errorf("apply: %w", &leasehold.StaleEpochError{Partition: 7, Epoch: 41, Max: 42, Worker: "w-a", Holder: "w-b"})
	if !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatal("StaleEpochError does not match ErrStaleEpoch")
	}
	if errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatal("StaleEpochError matches ErrLeaseLost")
	}
	var se *leasehold.StaleEpochError
	if !errors.As(err, &se) || se.Max != 42 {
		t.Fatalf("errors.As: %+v", se)
	}
	want := "partition 7: epoch 41 is below the recorded 42: worker w-a lost its lease"
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("message %q lacks %q", err, want)
	}
}

// The values Kafka's own tests give for its murmur2 (UtilsTest.testMurmur2).
func TestPartitionForMatchesKafka(t *testing.T) {
	cases := map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	}
	for key, h := range cases {
		want := leasehold.Partition(int(uint32(h)&0x7fffffff) % 16)
		if got := leasehold.PartitionFor([]byte(key), 16); got != want {
			t.Errorf("PartitionFor(%q, 16) = %d, want %d", key, got, want)
		}
	}
}

func FuzzStampFromHeader(f *testing.F) {
	f.Add("orders", "3", "17", "a1", "k")
	f.Add("", "", "0", "", "")
	f.Add("a b", "03", "+1", "a.b", "a b")
	f.Add("locks/account:42", "65535", "9223372036854775807", "0123456789abcdef01234567", "orders.1.2.3")
	f.Fuzz(func(t *testing.T, scope, p, e, acq, k string) {
		h := map[string][]string{
			leasehold.HeaderScope:       {scope},
			leasehold.HeaderPartition:   {p},
			leasehold.HeaderEpoch:       {e},
			leasehold.HeaderAcquisition: {acq},
			leasehold.HeaderKey:         {k},
		}
		s, err := leasehold.StampFromHeader(h)
		if err != nil {
			if s != (leasehold.Stamp{}) {
				t.Fatalf("error %v came with a partial stamp %+v", err, s)
			}
			return
		}
		if s.Epoch == 0 || s.Epoch > leasehold.MaxEpoch {
			t.Fatalf("accepted epoch %d from %q", s.Epoch, e)
		}
		if s.Epoch.String() != e || s.Partition.String() != p || s.Scope != scope || s.Acquisition != acq {
			t.Fatalf("accepted a non-canonical spelling: %q/%q read as %d/%d", p, e, s.Partition, s.Epoch)
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("a parsed stamp does not validate: %v", err)
		}
		h2 := map[string][]string{}
		s.SetHeader(h2)
		if s2, err := leasehold.StampFromHeader(h2); err != nil || s2 != s {
			t.Fatalf("round trip: %+v, %v", s2, err)
		}
	})
}

func TestJudge(t *testing.T) {
	st := func(e leasehold.Epoch, acq string) leasehold.Stamp {
		return leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: e, Acquisition: acq, Key: "k"}
	}
	cases := []struct {
		name  string
		fence leasehold.FenceState
		s     leasehold.Stamp
		v     leasehold.Verdict
		raise bool
	}{
		{"no fence yet", leasehold.FenceState{}, st(5, "a"), leasehold.Admit, true},
		{"higher epoch", leasehold.FenceState{Epoch: 5, Acquisition: "a"}, st(6, "b"), leasehold.Admit, true},
		{"same acquisition", leasehold.FenceState{Epoch: 5, Acquisition: "a"}, st(5, "a"), leasehold.Admit, false},
		{"fence without acquisition learns it", leasehold.FenceState{Epoch: 5}, st(5, "a"), leasehold.Admit, true},
		{"lower epoch", leasehold.FenceState{Epoch: 5, Acquisition: "a"}, st(4, "a"), leasehold.Stale, false},
		{"one epoch, two acquisitions", leasehold.FenceState{Epoch: 5, Acquisition: "a"}, st(5, "b"), leasehold.SplitBrain, false},
	}
	for _, c := range cases {
		v, raise := leasehold.Judge(c.fence, c.s)
		if v != c.v || raise != c.raise {
			t.Errorf("%s: Judge = %v, %v; want %v, %v", c.name, v, raise, c.v, c.raise)
		}
	}
}

func TestSplitBrainError(t *testing.T) {
	f := leasehold.FenceState{Epoch: 5, Acquisition: "a", Holder: "w-a"}
	s := leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 5, Acquisition: "b", Key: "k", Worker: "w-b"}
	err := error(leasehold.Refusal(f, s, leasehold.SplitBrain))
	if !errors.Is(err, leasehold.ErrStaleEpoch) || !errors.Is(err, leasehold.ErrSplitBrain) {
		t.Fatalf("%v: want both ErrStaleEpoch and ErrSplitBrain", err)
	}
	if stale := leasehold.Refusal(f, leasehold.Stamp{Scope: "orders", Partition: 1, Epoch: 4, Acquisition: "a", Key: "k"}, leasehold.Stale); errors.Is(stale, leasehold.ErrSplitBrain) {
		t.Fatalf("a stale refusal matches ErrSplitBrain: %v", stale)
	}
	for _, want := range []string{"scope orders partition 1", "another acquisition", "sync_interval"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q lacks %q", err, want)
		}
	}
}
