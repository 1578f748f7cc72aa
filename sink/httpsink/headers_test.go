package httpsink_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/httpsink"
)

// Every key a stamp may hold has an Idempotency-Key that parses back to
// one text, different for every scope and key: dedupe by it is dedupe by
// (scope, key).
func TestIdempotencyKeyRoundTrip(t *testing.T) {
	seen := map[string]string{}
	for _, tc := range []struct{ scope, key string }{
		{"orders", "orders.3.17.0"},
		{"orders", `quote"and\back`},
		{"orders", "per%cent"},
		{"orders", "per%25cent"},
		{"orders", "caf\xc3\xa9"},
		{"orders", "\xff\x80"},
		{"billing/account:42", "orders.3.17.0"},
		{"orders.3", "17.0"},
		{"orders", strings.Repeat("\xfe", leasehold.MaxKeyLen)},
	} {
		st := leasehold.Stamp{Scope: tc.scope, Partition: 1, Epoch: 1, Acquisition: "a", Key: tc.key}
		if err := st.Validate(); err != nil {
			t.Fatalf("%q %q: %v", tc.scope, tc.key, err)
		}
		v := httpsink.IdempotencyKey(st)
		for i := 0; i < len(v); i++ {
			if v[i] < 0x20 || v[i] > 0x7e {
				t.Errorf("%q: the value holds byte %#x", v, v[i])
			}
		}
		got, err := httpsink.ParseIdempotencyKey(v)
		if err != nil {
			t.Fatalf("%q does not parse: %v", v, err)
		}
		if prev, ok := seen[got]; ok {
			t.Errorf("%q %q and %s have one key %q", tc.scope, tc.key, prev, got)
		}
		seen[got] = tc.scope + " " + tc.key
		if !strings.HasPrefix(got, tc.scope+" ") {
			t.Errorf("%q does not start with its scope", got)
		}
	}
	if v := httpsink.IdempotencyKey(leasehold.Stamp{Scope: "orders", Key: "orders.3.17.0"}); v != `"orders orders.3.17.0"` {
		t.Errorf("a worker's key is written %s", v)
	}
}

func FuzzParseIdempotencyKey(f *testing.F) {
	for _, s := range []string{`"orders orders.3.17.0"`, `"a\"b"`, `"a\\b"`, `""`, `"`, `"a`, `a"`, `"a"b"`, `"a\x"`, "\"\x7f\""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		got, err := httpsink.ParseIdempotencyKey(v)
		if err != nil {
			return
		}
		// What parses is printable ASCII, and writes back to v.
		for i := 0; i < len(got); i++ {
			if got[i] < 0x20 || got[i] > 0x7e {
				t.Fatalf("%q parsed to %q with byte %#x", v, got, got[i])
			}
		}
		var b strings.Builder
		b.WriteByte('"')
		for i := 0; i < len(got); i++ {
			if got[i] == '"' || got[i] == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(got[i])
		}
		b.WriteByte('"')
		if b.String() != v {
			t.Fatalf("%q parsed to %q, which writes back as %q", v, got, b.String())
		}
	})
}

func FuzzRelayFromHeader(f *testing.F) {
	f.Add("hooks/relay", "17", "abc_1", "relay-a")
	f.Add("", "17", "abc", "")
	f.Add("hooks/relay", "017", "abc", "")
	f.Add("hooks relay", "1", "a", "")
	f.Fuzz(func(t *testing.T, scope, epoch, acq, worker string) {
		h := http.Header{}
		if scope != "" {
			h[httpsink.HeaderRelayScope] = []string{scope}
		}
		if epoch != "" {
			h[httpsink.HeaderRelayEpoch] = []string{epoch}
		}
		if acq != "" {
			h[httpsink.HeaderRelayAcquisition] = []string{acq}
		}
		if worker != "" {
			h[httpsink.HeaderRelayWorker] = []string{worker}
		}
		l, ok, err := httpsink.RelayFromHeader(h)
		if err != nil || !ok {
			return
		}
		// What is accepted is valid, and written back reads the same.
		if l.Stamp("x").Validate() != nil {
			t.Fatalf("accepted an invalid relay stamp %+v", l)
		}
		h2 := http.Header{}
		httpsink.SetRelayHeader(h2, l)
		l2, ok2, err2 := httpsink.RelayFromHeader(h2)
		if err2 != nil || !ok2 || l2 != l {
			t.Fatalf("%+v written and read back is %+v (%v)", l, l2, err2)
		}
	})
}
