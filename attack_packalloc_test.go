package leasehold_test

import (
	"runtime"
	"testing"

	"github.com/leasehold/leasehold"
)

// What reading a packed body costs in memory, per byte of it, when one
// header name is given a value hundreds of thousands of times. A sink holds
// what Unpack returns for every pack of a batch it decides (100 messages
// by default, and the next batch fetched), so a ratio of r makes a batch
// of packs near the max payload cost r times 100 MiB. A message's headers
// of the same shape, decoded by the NATS client, cost about 17 times their
// size; Unpack must cost no more than 20 times.
//
// It cost about 38 times when a name's values grew by append, one at a
// time, from a slice of one; an entry of many pairs now counts each name's
// values first. (Thousands of distinct names cost more, in the entry's
// header map; logged, not judged.)
func TestAttackUnpackAllocationPerByte(t *testing.T) {
	const limit = 20
	repeated := leasehold.AppendPacked(nil, leasehold.PackedEffect{Key: "s.0.1.0", Header: map[string][]string{"a": make([]string, 300000)}})
	repeated = leasehold.AppendPacked(repeated, leasehold.PackedEffect{Key: "s.0.1.1"})
	tok := "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	names := map[string][]string{}
	for _, a := range tok {
		for _, b := range tok {
			names[string(a)+string(b)] = []string{""}
		}
	}
	distinct := leasehold.AppendPacked(nil, leasehold.PackedEffect{Key: "s.0.1.0", Header: names})
	distinct = leasehold.AppendPacked(distinct, leasehold.PackedEffect{Key: "s.0.1.1", Header: names})
	for _, c := range []struct {
		name string
		body []byte
	}{{"one name repeated", repeated}, {"distinct names", distinct}} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		out, err := leasehold.Unpack(c.body, 2)
		runtime.ReadMemStats(&after)
		if err != nil {
			t.Fatal(c.name, err)
		}
		runtime.KeepAlive(out)
		alloc := after.TotalAlloc - before.TotalAlloc
		ratio := float64(alloc) / float64(len(c.body))
		t.Logf("%s: a body of %d bytes allocated %d (%.1f times)", c.name, len(c.body), alloc, ratio)
		if c.name == "one name repeated" && ratio > limit {
			t.Errorf("%s: a body of %d bytes allocated %d (%.1f times), above %d times", c.name, len(c.body), alloc, ratio, limit)
		}
	}
}
