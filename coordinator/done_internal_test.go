package coordinator

import (
	"encoding/base64"
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

// The done set survives its encoding, and a record with a done field that
// is not what encodeDone writes does not decode: jobs at or below the one
// before, numbers not in their shortest form, more than MaxDone jobs,
// sequences past 2^63, padding or another alphabet.
func TestDoneEncoding(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		seq  uint64
		done []uint64
	}{
		{0, nil}, {0, []uint64{1}}, {5, []uint64{6, 7, 1000, 1 << 40}}, {1<<63 - 2, []uint64{1<<63 - 1, 1 << 63}},
	} {
		s := encodeDone(tc.seq, tc.done)
		back, err := decodeDone(tc.seq, s)
		if err != nil || !slices.Equal(back, tc.done) {
			t.Errorf("%d %v: encoded %q, decoded %v, %v", tc.seq, tc.done, s, back, err)
		}
	}
	max := make([]uint64, MaxDone)
	for i := range max {
		max[i] = uint64(i) + 1
	}
	if back, err := decodeDone(0, encodeDone(0, max)); err != nil || len(back) != MaxDone {
		t.Errorf("MaxDone jobs: %d decoded, %v", len(back), err)
	}
	raw := func(b ...byte) string { return base64.RawURLEncoding.EncodeToString(b) }
	for name, s := range map[string]string{
		"a zero distance":          raw(1, 0),
		"not the shortest form":    raw(0x81, 0x00),
		"a number that never ends": raw(0x81),
		"past 2^63":                raw(0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01),
		"padding":                  base64.URLEncoding.EncodeToString([]byte{1}),
		"the standard alphabet":    "+/",
		"more than MaxDone":        encodeDone(0, append(max, MaxDone+1)),
		"non-zero padding bits":    "Ab",
	} {
		if got, err := decodeDone(0, s); err == nil {
			t.Errorf("%s (%q): decoded %v", name, s, got)
		}
		rec, _ := json.Marshal(map[string]any{"epoch": 3, "seq": 0, "holder": "w", "done": s})
		if _, err := decodeFence(rec); err == nil || !strings.Contains(err.Error(), "done") {
			t.Errorf("%s: a record with it decodes (%v)", name, err)
		}
	}
	if got, err := decodeDone(1<<63-1, raw(2)); err == nil {
		t.Errorf("a job past 2^63 after the watermark: decoded %v", got)
	}
}

// FuzzDone feeds done fields as they come off the wire: what decodes is
// ascending, above the watermark, at most MaxDone, and encodes back to the
// same text.
func FuzzDone(f *testing.F) {
	f.Add(uint64(0), encodeDone(0, []uint64{1, 2, 3}))
	f.Add(uint64(7), encodeDone(7, []uint64{9, 300, 1 << 40}))
	f.Add(uint64(1<<63-1), "AQ")
	f.Add(uint64(0), "gAA")
	f.Add(uint64(1), "00\r0") // the decoder skips line breaks
	f.Fuzz(func(t *testing.T, seq uint64, s string) {
		done, err := decodeDone(seq, s)
		if err != nil {
			return
		}
		if len(done) > MaxDone {
			t.Fatalf("decoded %d jobs", len(done))
		}
		prev := seq
		for _, d := range done {
			if d <= prev || d > 1<<63 {
				t.Fatalf("decoded %v after %d: not ascending above the watermark, or past 2^63", done, seq)
			}
			prev = d
		}
		if back := encodeDone(seq, done); back != s {
			t.Fatalf("%q decodes to %v, which encodes as %q", s, done, back)
		}
	})
}
