package coordinator

import (
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// slot is what the bucket says about one partition.
type slot struct {
	holder string // "" when free
	epoch  leasehold.Epoch
}

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
		var next slot
		if live {
			next = slot{holder: "?", epoch: leasehold.Epoch(e.Revision())}
			if r, err := decodeRecord(e.Value()); err == nil {
				next = slot{holder: r.Holder, epoch: epochOf(r, e.Revision())}
			}
		}
		if v.slots[p] == next {
			return false, false
		}
		v.slots[p] = next
		return true, false
	}
	return false, false
}
