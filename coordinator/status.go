package coordinator

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// PartitionStatus is what the buckets say about one partition.
type PartitionStatus struct {
	Partition leasehold.Partition `json:"partition"`
	// Holder and Epoch describe the live lease; Holder is "" when the
	// partition is free, and "?" when its key holds a record leasehold did
	// not write (see Status.Findings).
	Holder   string          `json:"holder,omitempty"`
	Epoch    leasehold.Epoch `json:"epoch,omitempty"`
	Acquired time.Time       `json:"acquired,omitzero"`
	// Renewed is the server time of the lease's last renewal: of the
	// partition record for a lease that renews itself, of its holder's
	// registration for one held by a session.
	Renewed time.Time     `json:"renewed,omitzero"`
	TTL     time.Duration `json:"ttl,omitempty"`
	// Session, for a lease held by its holder's member session, is the
	// revision that acquired the registration it lives by (0 for a lease
	// that renews itself); SessionEnded says that registration is gone or
	// replaced, so that the lease has ended and any worker may take the
	// partition.
	Session      uint64 `json:"session,omitempty"`
	SessionEnded bool   `json:"session_ended,omitempty"`
	// FencedEpoch and Progress come from the fence record: the newest
	// epoch that started work on the partition and the last input sequence
	// committed.
	FencedEpoch leasehold.Epoch `json:"fenced_epoch,omitempty"`
	Progress    uint64          `json:"progress"`
}

// LockStatus is what the buckets say about one lock.
type LockStatus struct {
	Name string `json:"name"`
	// Holder and Epoch describe the live lease, as for a partition.
	Holder   string          `json:"holder,omitempty"`
	Epoch    leasehold.Epoch `json:"epoch,omitempty"`
	Acquired time.Time       `json:"acquired,omitzero"`
	Renewed  time.Time       `json:"renewed,omitzero"`
	TTL      time.Duration   `json:"ttl,omitempty"`
	// FencedEpoch is the newest epoch the lock was fenced under.
	FencedEpoch leasehold.Epoch `json:"fenced_epoch,omitempty"`
}

// Status is a snapshot of the lease bucket and its fence records.
type Status struct {
	Partitions []PartitionStatus `json:"partitions"`
	Locks      []LockStatus      `json:"locks,omitempty"`
	Members    []string          `json:"members"`
	// Findings are records that are not leasehold's, or claim what cannot
	// be, with what to do about each.
	Findings []Finding `json:"findings,omitempty"`
}

// Snapshot reads every lease, lock, member and fence record, and checks
// each (see Findings). It reads both buckets through consumers their
// stream leaders serve; records written meanwhile may or may not show.
func (b *Bucket) Snapshot(ctx context.Context) (Status, error) {
	sn := snapshotter{b: b, parts: map[leasehold.Partition]*PartitionStatus{}, locks: map[string]*LockStatus{}, written: map[string]time.Time{}, members: map[string]session{}}
	if err := sn.context(ctx); err != nil {
		return Status{}, err
	}
	if err := scanLast(ctx, b.js, b.stream, b.prefix+">", sn.lease); err != nil {
		return Status{}, err
	}
	if err := scanLast(ctx, b.js, b.fenceStream, b.fencePrefix+">", sn.fence); err != nil {
		return Status{}, err
	}
	sn.checkLists()
	sn.sessions()
	st := sn.st
	for _, ps := range sn.parts {
		st.Partitions = append(st.Partitions, *ps)
	}
	for _, ls := range sn.locks {
		st.Locks = append(st.Locks, *ls)
	}
	slices.SortFunc(st.Partitions, func(a, b PartitionStatus) int { return int(a.Partition) - int(b.Partition) })
	slices.SortFunc(st.Locks, func(a, b LockStatus) int { return strings.Compare(a.Name, b.Name) })
	slices.Sort(st.Members)
	slices.SortStableFunc(st.Findings, func(a, b Finding) int {
		return strings.Compare(a.Bucket+" "+a.Key, b.Bucket+" "+b.Key)
	})
	return st, nil
}

// snapshotter folds the scanned records into a Status.
type snapshotter struct {
	b     *Bucket
	st    Status
	parts map[leasehold.Partition]*PartitionStatus
	locks map[string]*LockStatus

	lastRev    uint64 // the lease bucket's last revision when the snapshot began
	partitions int    // the job stream's partition count; 0 when not known
	jobsLast   uint64 // the job stream's last sequence
	haveJobs   bool

	lists   []listed             // the member registrations that list their holdings
	written map[string]time.Time // the server's time of each key's last write, markers included
	latest  time.Time            // the latest of them
	members map[string]session   // each live registration: the session partitions name
}

// session is a member registration as Snapshot found it.
type session struct {
	rev     uint64    // the revision that acquired it
	renewed time.Time // the server time of its last write
}

// listed is one registration's list, as Snapshot found it.
type listed struct {
	at    Finding
	id    string
	holds string
	ttl   time.Duration
}

// context reads what the records are checked against: the lease bucket's
// last revision and the job stream's partitions and last sequence.
func (sn *snapshotter) context(ctx context.Context) error {
	var err error
	if sn.lastRev, err = sn.b.lastRevision(ctx); err != nil {
		return err
	}
	s, err := sn.b.js.Stream(ctx, jobsStream(sn.b.scope))
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil
	case err != nil:
		return fmt.Errorf("coordinator: look up job stream %s: %w", jobsStream(sn.b.scope), err)
	}
	sn.haveJobs, sn.jobsLast = true, s.CachedInfo().State.LastSeq
	if n, err := sn.b.partitionCount(ctx); err == nil {
		sn.partitions = n
	}
	return nil
}

func (sn *snapshotter) part(p leasehold.Partition) *PartitionStatus {
	if sn.parts[p] == nil {
		sn.parts[p] = &PartitionStatus{Partition: p}
	}
	return sn.parts[p]
}

func (sn *snapshotter) lock(name string) *LockStatus {
	if sn.locks[name] == nil {
		sn.locks[name] = &LockStatus{Name: name}
	}
	return sn.locks[name]
}

func (sn *snapshotter) find(f Finding) { sn.st.Findings = append(sn.st.Findings, f) }

// lease folds one record of the lease bucket.
func (sn *snapshotter) lease(m scanned) error {
	key := strings.TrimPrefix(m.subject, sn.b.prefix)
	sn.written[key] = m.time
	if m.time.After(sn.latest) {
		sn.latest = m.time
	}
	if m.marker {
		return nil
	}
	at := Finding{Bucket: sn.b.name, Key: key, Revision: m.seq, Written: m.time}
	switch {
	case strings.HasPrefix(key, memberKeyPrefix):
		id := key[len(memberKeyPrefix):]
		r, foreign := foreignReason(m.data, m.header)
		if foreign == "" && r.Holder != id {
			foreign = fmt.Sprintf("the record names holder %q, not %q", r.Holder, id)
		}
		if foreign != "" {
			sn.find(at.foreign(foreign, "an unknown member: worker groups ignore it once it has stayed unchanged for a TTL, but it shows as a live worker"))
			return nil
		}
		sn.st.Members = append(sn.st.Members, id)
		sn.members[id] = session{rev: uint64(epochOf(r, m.seq)), renewed: m.time}
		if r.Holds != nil {
			sn.lists = append(sn.lists, listed{at: at, id: id, holds: *r.Holds, ttl: time.Duration(r.TTLMilli) * time.Millisecond})
		}
	case strings.HasPrefix(key, partitionKeyPrefix):
		p, err := leasehold.ParsePartition(key[len(partitionKeyPrefix):])
		if err != nil {
			sn.find(at.unknownKey())
			return nil
		}
		outside := sn.partitions > 0 && int(p) >= sn.partitions
		if outside {
			sn.find(at.outOfRange(p, sn.partitions))
		}
		ps := sn.part(p)
		ps.Renewed = m.time
		r, foreign := partitionReason(m.data, m.header)
		if foreign != "" {
			ps.Holder = "?"
			f := at.foreign(foreign, "the partition is held by nobody until the record goes")
			if !outside {
				// Repaired by fencing the partition; one outside the job
				// stream is only removed.
				f.Fence = &leasehold.FenceID{Scope: sn.b.scope, Partition: p}
			}
			sn.find(f)
			return nil
		}
		ps.Holder, ps.Epoch, ps.Acquired = r.Holder, epochOf(r, m.seq), r.Acquired
		ps.TTL = time.Duration(r.TTLMilli) * time.Millisecond
		if r.Session != 0 {
			ps.TTL, ps.Session = 0, r.Session // lives as long as the holder's registration
		}
	case strings.HasPrefix(key, lockKeyPrefix):
		name, err := decodeLockName(key[len(lockKeyPrefix):])
		if err != nil {
			sn.find(at.unknownKey())
			return nil
		}
		ls := sn.lock(name)
		ls.Renewed = m.time
		r, foreign := foreignReason(m.data, m.header)
		if foreign != "" {
			ls.Holder = "?"
			f := at.foreign(foreign, "the lock is held by nobody until the record goes")
			f.Fence = &leasehold.FenceID{Scope: leasehold.LockScope(sn.b.scope, name)}
			sn.find(f)
			return nil
		}
		ls.Holder, ls.Epoch, ls.Acquired = r.Holder, epochOf(r, m.seq), r.Acquired
		ls.TTL = time.Duration(r.TTLMilli) * time.Millisecond
	case strings.HasPrefix(key, progressKeyPrefix):
		if !isMoved(m.data) {
			sn.find(at.legacyProgress(sn.b.fenceName))
		}
	case key == "jobstream":
		// What an earlier leasehold recorded; the scope replaced it.
	case strings.HasPrefix(key, noticeKeyPrefix):
		// A Fence's word to a holder; it expires on its own.
	default:
		sn.find(at.unknownKey())
	}
	return nil
}

// sessions dates the renewal of each partition held by a session: the
// partition record is written only to acquire, and the lease is renewed
// with its holder's registration. A registration that is gone, or is
// another session, ended the lease.
func (sn *snapshotter) sessions() {
	for _, ps := range sn.parts {
		if ps.Session == 0 {
			continue
		}
		m, ok := sn.members[ps.Holder]
		if !ok || m.rev != ps.Session {
			ps.SessionEnded = true
			continue
		}
		ps.Renewed = m.renewed
	}
}

// checkLists finds the registrations whose lists have disagreed with the
// partition records for longer than a worker takes to list a change: a
// list is written within a second of it, and every renewal repeats it, so
// a registration written well after a partition's record that still
// claims it is not what a working member does. A partition without any
// record had its release marker expire, which dates the release a
// marker's TTL back at least; with markers shorter than a lease that says
// too little, and nothing is reported. Only
// claims are checked: a partition a member holds and does not list yet
// slows the group down, it does not stall a share.
func (sn *snapshotter) checkLists() {
	n := sn.partitions
	if n <= 0 {
		n = math.MaxInt32
	}
	for _, l := range sn.lists {
		ps, err := decodeHolds(l.holds, n)
		if err != nil {
			continue // the group does not read it either
		}
		var wrong []string
		for _, p := range ps {
			key := partitionKey(leasehold.Partition(p))
			holder := ""
			if s := sn.parts[leasehold.Partition(p)]; s != nil {
				holder = s.Holder
			}
			if holder == l.id || holder == "?" {
				continue // its own, or a foreign record already found
			}
			written, ok := sn.written[key]
			if !ok {
				// No record, not even a marker: if there was one, it
				// expired, so it was written a marker's TTL before the
				// scan, the latest write it met being the nearest to
				// the scan's time it knows.
				written = sn.latest.Add(-sn.b.markerTTL)
			}
			if l.at.Written.Sub(written) <= staleAfter(l.ttl, time.Second) {
				continue // written too recently to tell a stuck list from a slow one
			}
			if holder == "" {
				wrong = append(wrong, fmt.Sprintf("partition %d, which nobody holds", p))
			} else {
				wrong = append(wrong, fmt.Sprintf("partition %d, which %s holds", p, holder))
			}
		}
		if len(wrong) > 0 {
			sn.find(l.at.listDisagrees(l.id, wrong))
		}
	}
}

// fence folds one record of the fence-record bucket.
func (sn *snapshotter) fence(m scanned) error {
	if m.marker {
		return nil
	}
	key := strings.TrimPrefix(m.subject, sn.b.fencePrefix)
	at := Finding{Bucket: sn.b.fenceName, Key: key, Revision: m.seq, Written: m.time}
	var id leasehold.FenceID
	switch {
	case strings.HasPrefix(key, partitionKeyPrefix):
		p, err := leasehold.ParsePartition(key[len(partitionKeyPrefix):])
		if err != nil {
			sn.find(at.unknownKey())
			return nil
		}
		id = leasehold.FenceID{Scope: sn.b.scope, Partition: p}
	case strings.HasPrefix(key, lockKeyPrefix):
		name, err := decodeLockName(key[len(lockKeyPrefix):])
		if err != nil {
			sn.find(at.unknownKey())
			return nil
		}
		id = leasehold.FenceID{Scope: leasehold.LockScope(sn.b.scope, name)}
	default:
		sn.find(at.unknownKey())
		return nil
	}
	at.Fence = &id
	r, err := decodeFence(m.data)
	if err != nil {
		sn.find(at.garbledFence(err))
		return nil
	}
	if h := r.highest(); h > sn.lastRev {
		sn.find(at.epochAhead(h, sn.lastRev))
	}
	if id.Scope != sn.b.scope {
		sn.lock(strings.TrimPrefix(id.Scope, sn.b.scope+"/")).FencedEpoch = leasehold.Epoch(r.Epoch)
		return nil
	}
	ps := sn.part(id.Partition)
	ps.FencedEpoch, ps.Progress = leasehold.Epoch(r.Epoch), r.Seq
	if sn.haveJobs && r.Seq > sn.jobsLast {
		sn.find(at.progressAhead(r.Seq, sn.jobsLast))
	}
	return nil
}
