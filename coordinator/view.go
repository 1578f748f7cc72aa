package coordinator

import (
	"hash/maphash"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// slot is what the bucket says about one partition.
type slot struct {
	holder string // "" when free
	epoch  leasehold.Epoch
	sum    uint64 // hash of the record it was read from; 0 when not read from one
}

// recordSeed hashes lease records, so that a renewal, which repeats its
// lease's record byte for byte, is recognised without decoding it: every
// worker sees every renewal of every partition.
var recordSeed = maphash.MakeSeed()

// view is a worker's picture of the bucket, built from the watch. It is
// advisory: decisions it leads to are compare-and-set writes the server
// checks.
type view struct {
	slots   []slot
	members map[string]bool
}

func newView(n int) *view {
	return &view{slots: make([]slot, n), members: map[string]bool{}}
}

// apply folds one watch entry into the view and reports whether ownership
// or membership changed.
func (v *view) apply(e jetstream.KeyValueEntry) bool {
	changed, _ := v.applyKind(e)
	return changed
}

// applyKind is apply that also tells whether the change was to membership.
func (v *view) applyKind(e jetstream.KeyValueEntry) (changed, membership bool) {
	live := e.Operation() == jetstream.KeyValuePut
	switch key := e.Key(); {
	case strings.HasPrefix(key, memberKeyPrefix):
		m := key[len(memberKeyPrefix):]
		if v.members[m] == live {
			return false, false
		}
		if live {
			v.members[m] = true
		} else {
			delete(v.members, m)
		}
		return true, true
	case strings.HasPrefix(key, partitionKeyPrefix):
		p, err := leasehold.ParsePartition(key[len(partitionKeyPrefix):])
		if err != nil || int(p) >= len(v.slots) {
			return false, false
		}
		cur := &v.slots[p]
		var next slot
		if live {
			sum := maphash.Bytes(recordSeed, e.Value())
			if cur.sum == sum && cur.holder != "" {
				return false, false // a renewal of the lease already known
			}
			next = slot{holder: "?", epoch: leasehold.Epoch(e.Revision()), sum: sum}
			if r, err := decodeRecord(e.Value()); err == nil {
				next.holder, next.epoch = r.Holder, epochOf(r, e.Revision())
			}
		}
		changed = cur.holder != next.holder || cur.epoch != next.epoch
		*cur = next
		return changed, false
	}
	return false, false
}
