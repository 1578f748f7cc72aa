package leasehold_test

import (
	"errors"
	"hash/fnv"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

// An order key is the FNV-1a 64-bit hash of the partition key, as 16
// lowercase hex digits, and has exactly that one spelling.
func TestOrderKey(t *testing.T) {
	for _, key := range []string{"", "a", "order-1234", "\x00\xff binary"} {
		got := leasehold.OrderKey([]byte(key))
		h := fnv.New64a()
		h.Write([]byte(key))
		want := h.Sum64()
		if len(got) != 16 || strings.ToLower(got) != got {
			t.Errorf("OrderKey(%q) = %q, not 16 lowercase hex digits", key, got)
		}
		if v, err := leasehold.ParseOrderKey(got); err != nil || v != want {
			t.Errorf("ParseOrderKey(OrderKey(%q) = %q) = %x, %v; want %x", key, got, v, err, want)
		}
	}
	if got := leasehold.OrderKey(nil); got != "cbf29ce484222325" {
		t.Errorf("OrderKey(nil) = %q, want FNV-1a's offset basis cbf29ce484222325", got)
	}
	for _, bad := range []string{"", "cbf29ce48422232", "cbf29ce4842223250", "CBF29CE484222325", "cbf29ce48422232g", " bf29ce484222325", "-", "0x29ce484222325a"} {
		if v, err := leasehold.ParseOrderKey(bad); !errors.Is(err, leasehold.ErrBadOrderKey) {
			t.Errorf("ParseOrderKey(%q) = %x, %v; want ErrBadOrderKey", bad, v, err)
		}
	}
	k := leasehold.OrderKey([]byte("k"))
	for name, h := range map[string]map[string][]string{
		"twice, different": {leasehold.HeaderOrderKey: {k}, "leasehold-order-key": {leasehold.OrderKey([]byte("j"))}},
		"malformed":        {"LEASEHOLD-ORDER-KEY": {"k"}},
	} {
		if _, ok, err := leasehold.OrderKeyFromHeader(h); ok || !errors.Is(err, leasehold.ErrBadOrderKey) {
			t.Errorf("%s: ok %v, %v; want ErrBadOrderKey", name, ok, err)
		}
	}
	if v, ok, err := leasehold.OrderKeyFromHeader(map[string][]string{"leasehold-order-key": {k, k}}); !ok || err != nil || leasehold.OrderKey([]byte("k")) != k || v == 0 {
		t.Errorf("one value twice, in another case: %x, %v, %v", v, ok, err)
	}
	if _, ok, err := leasehold.OrderKeyFromHeader(map[string][]string{"Leasehold-Order": {k}}); ok || err != nil {
		t.Errorf("no order key: ok %v, %v; want none and no error", ok, err)
	}
}

// FuzzOrderKeyHeader feeds header maps as they arrive off the wire: an
// order key is read only when every spelling of the header says the same
// 16 lowercase hex digits, which are what it formats back to; everything
// else is an error matching ErrBadOrderKey, or no key at all.
func FuzzOrderKeyHeader(f *testing.F) {
	f.Add("Leasehold-Order-Key", "cbf29ce484222325", "", "")
	f.Add("leasehold-order-key", "cbf29ce484222325", "LEASEHOLD-ORDER-KEY", "cbf29ce484222325")
	f.Add("Leasehold-Order-Key", "CBF29CE484222325", "X", "y")
	f.Add("Leasehold-Order-Key", "-", "Leasehold-Order-Key", "0000000000000000")
	f.Add("Leasehold-Order-Key", "ffffffffffffffff", "Leasehold-Order-Key", "fffffffffffffffe")
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2 string) {
		h := map[string][]string{}
		for _, kv := range [][2]string{{n1, v1}, {n2, v2}} {
			h[kv[0]] = append(h[kv[0]], kv[1])
		}
		key, ok, err := leasehold.OrderKeyFromHeader(h)
		if err != nil {
			if ok || key != 0 || !errors.Is(err, leasehold.ErrBadOrderKey) {
				t.Fatalf("%x, %v, %v: an error with a key, or not ErrBadOrderKey", key, ok, err)
			}
			return
		}
		named := false
		for k, vs := range h {
			if !strings.EqualFold(k, leasehold.HeaderOrderKey) {
				continue
			}
			named = true
			for _, v := range vs {
				if want := strconv.FormatUint(key, 16); v != strings.Repeat("0", 16-len(want))+want {
					t.Fatalf("read %x beside the spelling %q", key, v)
				}
			}
		}
		if ok != named {
			t.Fatalf("ok %v, and the header is given: %v", ok, named)
		}
	})
}
