package leasehold_test

import (
	"encoding/binary"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

func packOf(es ...leasehold.PackedEffect) []byte {
	var body []byte
	for _, e := range es {
		body = leasehold.AppendPacked(body, e)
	}
	return body
}

func TestPackRoundTrip(t *testing.T) {
	es := []leasehold.PackedEffect{
		{Key: "orders.3.17.0", Header: map[string][]string{"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "X-Tenant": {"a", "b"}}, Data: []byte("first")},
		{Key: "orders.3.17.1", Data: nil},
		{Key: "orders.3.17.2", Header: map[string][]string{"X-Empty": {""}}, Data: make([]byte, 300)},
	}
	body := packOf(es...)
	size := 0
	for _, e := range es {
		size += leasehold.PackedSize(e)
	}
	if size != len(body) {
		t.Fatalf("PackedSize says %d bytes, AppendPacked wrote %d", size, len(body))
	}
	got, err := leasehold.Unpack(body, len(es))
	if err != nil {
		t.Fatal(err)
	}
	for i := range es {
		want := es[i]
		if want.Data == nil {
			want.Data = []byte{}
		}
		if got[i].Key != want.Key || string(got[i].Data) != string(want.Data) || !sameHeader(got[i].Header, want.Header) {
			t.Fatalf("entry %d: got %+v, want %+v", i, got[i], want)
		}
	}
	// Appending to a value of one entry's header must not write into
	// another's.
	got[0].Header["X-Tenant"] = append(got[0].Header["X-Tenant"], "c")
	if !sameHeader(got[2].Header, es[2].Header) {
		t.Fatalf("entries share header storage: %v", got[2].Header)
	}
}

func sameHeader(a, b map[string][]string) bool {
	if len(a) == 0 && len(b) == 0 {
		return true
	}
	return reflect.DeepEqual(a, b)
}

func TestPackCount(t *testing.T) {
	h := map[string][]string{"leasehold-pack": {"1 3"}}
	leasehold.SetPackHeader(h, 5)
	if n, err := leasehold.PackCount(h); err != nil || n != 5 || len(h) != 1 {
		t.Fatalf("after SetPackHeader: %d, %v, %v", n, err, h)
	}
	if n, err := leasehold.PackCount(map[string][]string{"X": {"1 3"}}); n != 0 || err != nil {
		t.Fatalf("no pack header: %d, %v", n, err)
	}
	max := strconv.Itoa(leasehold.MaxPackEffects)
	if n, err := leasehold.PackCount(map[string][]string{"LEASEHOLD-PACK": {"1 " + max}}); n != leasehold.MaxPackEffects || err != nil {
		t.Fatalf("the largest count: %d, %v", n, err)
	}
	for _, h := range []map[string][]string{
		{leasehold.HeaderPack: {"1 1"}},
		{leasehold.HeaderPack: {"1 0"}},
		{leasehold.HeaderPack: {"1 " + strconv.Itoa(leasehold.MaxPackEffects+1)}},
		{leasehold.HeaderPack: {"1 03"}},
		{leasehold.HeaderPack: {"1  3"}},
		{leasehold.HeaderPack: {"1 3 "}},
		{leasehold.HeaderPack: {"2 3"}},
		{leasehold.HeaderPack: {"3"}},
		{leasehold.HeaderPack: {"1 +3"}},
		{leasehold.HeaderPack: {""}},
		{leasehold.HeaderPack: {}},
		{leasehold.HeaderPack: {"1 3", "1 3"}},
		{leasehold.HeaderPack: {"1 3"}, "leasehold-pack": {"1 3"}},
	} {
		if n, err := leasehold.PackCount(h); err == nil || !errors.Is(err, leasehold.ErrBadPack) {
			t.Errorf("%v: read %d, %v", h, n, err)
		}
	}
}

// TestUnpackRefuses: every rule of the form breaks the whole message.
func TestUnpackRefuses(t *testing.T) {
	e := func(key string, h map[string][]string) leasehold.PackedEffect {
		return leasehold.PackedEffect{Key: key, Header: h, Data: []byte("d")}
	}
	good := packOf(e("k.0", nil), e("k.1", nil))
	huge := binary.AppendUvarint(nil, 1<<62)
	cases := map[string]struct {
		body []byte
		n    int
		want string
	}{
		"fewer entries than counted": {good, 3, "ends within"},
		"more entries than counted":  {packOf(e("k.0", nil), e("k.1", nil), e("k.2", nil)), 2, "follow the last"},
		"trailing bytes":             {append(append([]byte{}, good...), 0), 2, "follow the last"},
		"truncated":                  {good[:len(good)-1], 2, "runs past"},
		"huge key length":            {append(append([]byte{}, huge...), good...), 2, "runs past"},
		"huge header count":          {append(append([]byte{1, 'k'}, huge...), good...), 2, "cannot fit"},
		"overlong uvarint":           {append([]byte{0x81, 0x00, 'k'}, good...), 3, "shortest form"},
		"length past 64 bits":        {append([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, good...), 3, "overflows"},
		"empty key":                  {packOf(e("", nil), e("k.1", nil)), 2, "empty"},
		"key with a space":           {packOf(e("k 0", nil), e("k.1", nil)), 2, "space"},
		"key too long":               {packOf(e(strings.Repeat("k", leasehold.MaxKeyLen+1), nil), e("k.1", nil)), 2, "limit"},
		"duplicate keys":             {packOf(e("k.0", nil), e("k.0", nil)), 2, "distinct"},
		"duplicate keys, many":       {packOf(manyKeys(40, 3, 37)...), 40, "entry 37: key \"k.3\" is the key of entry 3"},
		"n of one":                   {packOf(e("k.0", nil)), 1, "outside"},
		"n above the bound":          {good, leasehold.MaxPackEffects + 1, "outside"},
	}
	for _, name := range []string{
		leasehold.HeaderStamp, "leasehold-stamp", leasehold.HeaderMark, "LEASEHOLD-MARK", leasehold.HeaderKey, "leasehold-epoch",
		leasehold.HeaderJob, leasehold.HeaderEffects, leasehold.HeaderAbort, leasehold.HeaderPack, "leasehold-PACK",
		leasehold.HeaderBarrier, "Nats-Msg-Id", "nats-expected-stream", "Bad Name", "Bad:Name", "", "X\r\nY",
	} {
		cases["header "+strconv.Quote(name)] = struct {
			body []byte
			n    int
			want string
		}{packOf(e("k.0", map[string][]string{name: {"v"}}), e("k.1", nil)), 2, "entry 0"}
	}
	for name, c := range cases {
		got, err := leasehold.Unpack(c.body, c.n)
		if err == nil || !errors.Is(err, leasehold.ErrBadPack) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: read %d entries, error %v (want one saying %q)", name, len(got), err, c.want)
		}
	}
}

// TestUnpackAllocations: reading a pack costs the body's string, the slice
// of entries, a map per entry with headers (two allocations each) and
// the values' slices, shared by the entries.
func TestUnpackAllocations(t *testing.T) {
	es := make([]leasehold.PackedEffect, 3)
	for i := range es {
		es[i] = leasehold.PackedEffect{Key: leasehold.EffectKey("orders", 3, 17, i), Data: make([]byte, 256)}
	}
	body := packOf(es...)
	if n := testing.AllocsPerRun(100, func() {
		if _, err := leasehold.Unpack(body, 3); err != nil {
			t.Fatal(err)
		}
	}); n > 2 {
		t.Fatalf("Unpack of 3 entries without headers allocates %v times; want at most 2", n)
	}
	for i := range es {
		es[i].Header = map[string][]string{"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	}
	body = packOf(es...)
	if n := testing.AllocsPerRun(100, func() {
		if _, err := leasehold.Unpack(body, 3); err != nil {
			t.Fatal(err)
		}
	}); n > 2+1+2*3 {
		t.Fatalf("Unpack of 3 entries with a header each allocates %v times; want at most 9", n)
	}
}

// manyKeys is n entries with keys k.0, k.1, ..., but entry dup's key is
// entry of's.
func manyKeys(n, of, dup int) []leasehold.PackedEffect {
	es := make([]leasehold.PackedEffect, n)
	for i := range es {
		es[i] = leasehold.PackedEffect{Key: "k." + strconv.Itoa(i)}
	}
	es[dup].Key = es[of].Key
	return es
}

// A pack of the most effects reads, and one whose last key repeats the
// first is refused, without a look at every pair of keys.
func TestUnpackMany(t *testing.T) {
	es := make([]leasehold.PackedEffect, leasehold.MaxPackEffects)
	for i := range es {
		es[i] = leasehold.PackedEffect{Key: leasehold.EffectKey("orders", 3, 17, i), Data: []byte{byte(i)}}
	}
	got, err := leasehold.Unpack(packOf(es...), len(es))
	if err != nil || len(got) != len(es) || got[len(es)-1].Key != es[len(es)-1].Key {
		t.Fatalf("read %d entries, %v", len(got), err)
	}
	es[len(es)-1].Key = es[0].Key
	if _, err := leasehold.Unpack(packOf(es...), len(es)); err == nil || !strings.Contains(err.Error(), "is the key of entry 0") {
		t.Fatalf("a repeated key: %v", err)
	}
}
