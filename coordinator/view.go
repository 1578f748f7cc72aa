package coordinator

import (
	"hash/maphash"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// slot is what the bucket says about one partition.
type slot struct {
	holder string // "" when free; "?" when the record does not decode
	epoch  leasehold.Epoch
	sum    uint64 // hash of the record it was read from; 0 when not read from one
	// rev is the revision of the last write seen on the key, and since
	// when this worker first saw it: a lease renews well within its TTL,
	// so a revision that stays longer than that belongs to a record the
	// server does not expire.
	rev   uint64
	since time.Time
	ttl   time.Duration // the TTL the record names; 0 when it does not decode
	// session is the holder's session the record names (the default; Config.RenewPartitions turns it off);
	// 0 for a lease that renews itself. Such a record stays unchanged for
	// as long as it is held.
	session uint64
}

// member is what the bucket says about one member key.
type member struct {
	rev     uint64
	since   time.Time
	sum     uint64
	ttl     time.Duration
	foreign bool   // the record does not decode as this member's registration
	session uint64 // the revision that acquired the registration
	// checked says the record at rev was read through the leader once it
	// looked stale, and ttlless what that found: a record the server does
	// not expire.
	checked, ttlless bool
	// adverts says the record lists the partitions its member holds
	// (record.Holds), holds what it lists, ascending; badHolds that the
	// record has a list that does not decode, which counts as no list.
	adverts  bool
	holds    []int32
	badHolds string
	// listSince is when this worker first saw the record list what it
	// lists now.
	listSince time.Time
}

// recordSeed hashes lease records, so that a renewal, which repeats its
// lease's record byte for byte, is recognised without decoding it: every
// worker sees every renewal of every partition.
var recordSeed = maphash.MakeSeed()

// view is a worker's picture of the bucket, built from the watch. It is
// advisory: decisions it leads to are compare-and-set writes the server
// checks.
type view struct {
	n       int    // the group's partitions
	slots   []slot // by partition; nil without the partition records
	members map[string]*member
	// partitions says the view is built from the partition records too;
	// without them, who holds what is what the members' records list.
	partitions bool
}

func newView(n int, partitions bool) *view {
	v := &view{n: n, members: map[string]*member{}, partitions: partitions}
	if partitions {
		v.slots = make([]slot, n)
	}
	return v
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
	now := time.Now()
	switch key := e.Key(); {
	case strings.HasPrefix(key, memberKeyPrefix):
		id := key[len(memberKeyPrefix):]
		cur := v.members[id]
		if !live {
			if cur == nil {
				return false, false
			}
			delete(v.members, id)
			return true, true
		}
		sum := maphash.Bytes(recordSeed, e.Value())
		if cur != nil && cur.sum == sum {
			cur.rev, cur.since = e.Revision(), now // a renewal
			return false, false
		}
		next := &member{rev: e.Revision(), since: now, sum: sum, foreign: true}
		if r, err := decodeRecord(e.Value()); err == nil && r.Holder == id && r.TTLMilli > 0 {
			next.ttl, next.foreign = time.Duration(r.TTLMilli)*time.Millisecond, false
			next.session = uint64(epochOf(r, e.Revision()))
			if r.Holds != nil {
				holds, err := decodeHolds(*r.Holds, v.n)
				if err != nil {
					next.badHolds = err.Error()
				} else {
					next.adverts, next.holds = true, holds
				}
			}
		}
		v.members[id] = next
		joined := cur == nil || cur.foreign != next.foreign || cur.session != next.session
		// A new list changes who holds what, not who is a member: it must
		// not hold back the hand-offs that wait for membership to settle.
		lists := cur == nil || cur.adverts != next.adverts || !slices.Equal(cur.holds, next.holds)
		next.listSince = now
		if !lists {
			next.listSince = cur.listSince
		}
		return joined || lists, joined
	case strings.HasPrefix(key, partitionKeyPrefix):
		p, err := leasehold.ParsePartition(key[len(partitionKeyPrefix):])
		if err != nil || int(p) >= len(v.slots) {
			return false, false
		}
		cur := &v.slots[p]
		// A free partition keeps the revision of its marker: the next
		// acquisition expects it.
		next := slot{rev: e.Revision(), since: now}
		if live {
			sum := maphash.Bytes(recordSeed, e.Value())
			if cur.sum == sum && cur.holder != "" {
				cur.rev, cur.since = e.Revision(), now // a renewal of the lease already known
				return false, false
			}
			next = slot{holder: "?", epoch: leasehold.Epoch(e.Revision()), sum: sum, rev: e.Revision(), since: now}
			if r, err := decodeRecord(e.Value()); err == nil {
				next.holder, next.epoch = r.Holder, epochOf(r, e.Revision())
				next.ttl = time.Duration(r.TTLMilli) * time.Millisecond
				if r.Session != 0 && r.TTLMilli == sessionTTLMilli {
					next.session, next.ttl = r.Session, 0
				}
			}
		}
		changed = cur.holder != next.holder || cur.epoch != next.epoch
		*cur = next
		return changed, false
	}
	return false, false
}

// inherit keeps, for every record old saw at the same revision, when old
// first saw it: a rescan reads every record afresh, and must not make a
// record that never changes look new again.
func (v *view) inherit(old *view) {
	for p := range v.slots {
		if p < len(old.slots) && v.slots[p].rev != 0 && v.slots[p].rev == old.slots[p].rev {
			v.slots[p].since = old.slots[p].since
		}
	}
	for id, m := range v.members {
		if o := old.members[id]; o != nil && o.rev == m.rev {
			m.since, m.checked, m.ttlless = o.since, o.checked, o.ttlless
		}
		if o := old.members[id]; o != nil && o.adverts == m.adverts && slices.Equal(o.holds, m.holds) {
			m.listSince = o.listSince
		}
	}
}

// staleAfter is how long a record naming ttl may stay unchanged before
// this worker concludes the server does not expire it: a holder renews
// several times a TTL, and the server expires a record it stops renewing
// about a TTL after its last write. A record that names no TTL gets this
// worker's.
func staleAfter(ttl, own time.Duration) time.Duration {
	if ttl <= 0 {
		ttl = own
	}
	return ttl + max(ttl/2, time.Second)
}

// stuck reports whether the partition record in s has stayed unchanged for
// longer than a lease could.
// A session-held record is never stuck: it lives as long as its session.
func (s slot) stuck(now time.Time, own time.Duration) bool {
	return s.holder != "" && s.session == 0 && s.rev != 0 && now.Sub(s.since) > staleAfter(s.ttl, own)
}

// dead reports whether m is known not to be a live registration: a record
// leasehold did not write, or one the server does not expire.
func (m *member) dead() bool { return m.foreign || m.ttlless }

// suspect reports whether m has stayed unchanged for longer than a
// registration could, and has not been checked at this revision yet.
func (m *member) suspect(now time.Time, own time.Duration) bool {
	return !m.dead() && !m.checked && now.Sub(m.since) > staleAfter(m.ttl, own)
}
