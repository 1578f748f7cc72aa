package leasehold_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

func TestParseOrigin(t *testing.T) {
	good := map[string]leasehold.Origin{
		"orders/3/17":                 {Scope: "orders", Partition: 3, Seq: 17},
		"ns/lock/0/1":                 {Scope: "ns/lock", Partition: 0, Seq: 1},
		"a/65535/9223372036854775808": {Scope: "a", Partition: 65535, Seq: 1 << 63},
	}
	for s, want := range good {
		o, err := leasehold.ParseOrigin(s)
		if err != nil || o != want || o.String() != s {
			t.Errorf("ParseOrigin(%q) = %+v, %v; want %+v", s, o, err, want)
		}
	}
	for _, s := range []string{"", "orders", "orders/3", "/3/17", "orders/3/0", "orders/03/17", "orders/3/017", "orders/-3/17",
		"orders/65536/1", "orders/3/9223372036854775809", "or ders/3/17", "orders/3/17 ", "orders//17", strings.Repeat("s", 161) + "/0/1"} {
		if o, err := leasehold.ParseOrigin(s); err == nil || !errors.Is(err, leasehold.ErrBadOrigin) || o != (leasehold.Origin{}) {
			t.Errorf("ParseOrigin(%q) = %+v, %v; want an error matching ErrBadOrigin", s, o, err)
		}
	}
	// The keys of a job that never moved are the ones EffectKey always gave.
	o := leasehold.OriginOf("orders", 3, 17)
	if o.EffectKey(2) != leasehold.EffectKey("orders", 3, 17, 2) {
		t.Errorf("origin key %s, place key %s", o.EffectKey(2), leasehold.EffectKey("orders", 3, 17, 2))
	}
	long := leasehold.Origin{Scope: strings.Repeat("s", leasehold.MaxOriginScopeLen), Partition: leasehold.MaxPartitions - 1, Seq: 1 << 63}
	if err := long.Validate(); err != nil {
		t.Fatal(err)
	}
	if k := long.EffectKey(1 << 30); len(k) > leasehold.MaxKeyLen {
		t.Errorf("the longest origin gives a key of %d bytes, above MaxKeyLen", len(k))
	}
}

// FuzzOriginHeader feeds header maps as they arrive off the wire. An
// origin is read only when every spelling of the header says the same
// canonical value, and what is read writes back the same; a map without
// the header has none; everything else is an OriginError.
func FuzzOriginHeader(f *testing.F) {
	f.Add("Leasehold-Origin", "orders/3/17", "leasehold-origin", "orders/3/17", "X", "y")
	f.Add("Leasehold-Origin", "orders/3/17", "LEASEHOLD-ORIGIN", "orders/3/18", "", "")
	f.Add("Leasehold-Origin", "ns/x/0/1", "Leasehold-Originx", "a/1/1", "Leasehold-Key", "k")
	f.Add("leasehold-origin", "orders/03/17", "", "", "", "")
	f.Add("Leasehold-Origin", "orders/3/0", "Leasehold-Origin", "/3/1", "", "")
	f.Add("Leasehold-Origin", "orders/3/18446744073709551615", "X", "", "", "")
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2, n3, v3 string) {
		h := map[string][]string{}
		for _, kv := range [][2]string{{n1, v1}, {n2, v2}, {n3, v3}} {
			h[kv[0]] = append(h[kv[0]], kv[1])
		}
		o, ok, err := leasehold.OriginFromHeader(h)
		if err != nil {
			var oe *leasehold.OriginError
			if !errors.As(err, &oe) || !errors.Is(err, leasehold.ErrBadOrigin) || ok || o != (leasehold.Origin{}) {
				t.Fatalf("error %v (ok %v, %+v) is not a bare OriginError matching ErrBadOrigin", err, ok, o)
			}
			if !strings.Contains(err.Error(), leasehold.HeaderOrigin) {
				t.Fatalf("error %q does not name the header", err)
			}
			return
		}
		spelled := false
		for k, vs := range h {
			if !strings.EqualFold(k, leasehold.HeaderOrigin) {
				continue
			}
			for _, v := range vs {
				spelled = true
				if !ok || v != o.String() {
					t.Fatalf("read %+v (ok %v) beside the spelling %q", o, ok, v)
				}
			}
		}
		if ok != spelled {
			t.Fatalf("ok %v, but the header was given: %v", ok, spelled)
		}
		if !ok {
			return
		}
		if err := o.Validate(); err != nil || o.Seq == 0 || len(o.Scope) > leasehold.MaxOriginScopeLen {
			t.Fatalf("read %+v, which does not validate: %v", o, err)
		}
		if k := o.EffectKey(1 << 20); len(k) > leasehold.MaxKeyLen {
			t.Fatalf("origin %s gives a key of %d bytes", o, len(k))
		}
		out := map[string][]string{"leasehold-ORIGIN": {"junk"}}
		o.SetHeader(out)
		if back, ok, err := leasehold.OriginFromHeader(out); err != nil || !ok || back != o {
			t.Fatalf("round trip: %+v, %v, %v; want %+v", back, ok, err, o)
		}
	})
}
