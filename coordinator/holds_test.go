package coordinator

import (
	"encoding/base64"
	"slices"
	"testing"

	"github.com/leasehold/leasehold"
)

func TestHoldsRoundTrip(t *testing.T) {
	t.Parallel()
	for _, ps := range [][]leasehold.Partition{nil, {0}, {5}, {0, 1, 2}, {3, 200, 65535}, {127, 128, 16383, 16384}} {
		s := encodeHolds(ps)
		got, err := decodeHolds(s, leasehold.MaxPartitions)
		if err != nil {
			t.Fatalf("%v: %v", ps, err)
		}
		want := make([]int32, len(ps))
		for i, p := range ps {
			want[i] = int32(p)
		}
		if !slices.Equal(got, want) && len(got)+len(want) > 0 {
			t.Fatalf("%v encoded as %q decodes as %v", ps, s, got)
		}
	}
	all := make([]leasehold.Partition, leasehold.MaxPartitions)
	for i := range all {
		all[i] = leasehold.Partition(i)
	}
	if s := encodeHolds(all); len(s) > 90_000 {
		t.Fatalf("every partition takes %d characters; a registration must stay well below the 1 MiB a message may carry", len(s))
	}
}

func TestHoldsRefusesWhatNoMemberWrites(t *testing.T) {
	t.Parallel()
	raw := func(b ...byte) string { return base64.RawURLEncoding.EncodeToString(b) }
	for name, s := range map[string]string{
		"not base64":       "!!",
		"repeat":           raw(3, 0),
		"beyond the group": raw(16),
		"sum beyond":       raw(10, 6),
		"unterminated":     raw(0x80),
		"too long":         string(make([]byte, 200)),
	} {
		if got, err := decodeHolds(s, 16); err == nil {
			t.Errorf("%s: %q decodes as %v", name, s, got)
		}
	}
}

// FuzzDecodeHolds feeds decodeHolds what a forger could put in a member
// record: it must refuse or return ascending, distinct partitions of the
// group, and what it returns must encode back to the same list.
func FuzzDecodeHolds(f *testing.F) {
	f.Add(encodeHolds([]leasehold.Partition{1, 2, 300}), 4096)
	f.Add("", 1)
	f.Add("gAE", 65536)
	f.Fuzz(func(t *testing.T, s string, n int) {
		if n <= 0 || n > leasehold.MaxPartitions {
			return
		}
		got, err := decodeHolds(s, n)
		if err != nil {
			return
		}
		ps := make([]leasehold.Partition, len(got))
		for i, p := range got {
			if p < 0 || int(p) >= n || (i > 0 && p <= got[i-1]) {
				t.Fatalf("%q decodes as %v", s, got)
			}
			ps[i] = leasehold.Partition(p)
		}
		back, err := decodeHolds(encodeHolds(ps), n)
		if err != nil || !slices.Equal(back, got) {
			t.Fatalf("%v does not survive encoding: %v %v", got, back, err)
		}
	})
}
