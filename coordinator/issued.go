package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// ErrUnknownFence is matched by the error IssuedEpoch returns for a fence
// the lease bucket issues no epochs for.
var ErrUnknownFence = errors.New("coordinator: the lease bucket issues no epochs for this fence")

// UnknownFenceError reports a fence the lease bucket does not serve: a
// scope other than its own or its locks', a partition outside its job
// stream's partition count, a malformed lock name. It is a verdict on the
// stamp, not a failure to reach the bucket: a sink refuses the write as
// unverified rather than retrying it.
type UnknownFenceError struct {
	Fence  leasehold.FenceID
	Bucket string
	Reason string
}

func (e *UnknownFenceError) Error() string {
	return fmt.Sprintf("coordinator: lease bucket %s issues no epochs for %s: %s", e.Bucket, e.Fence, e.Reason)
}

// Is makes errors.Is(err, ErrUnknownFence) true.
func (e *UnknownFenceError) Is(target error) bool { return target == ErrUnknownFence }

// Unverified reports that the stamp, not the lease bucket, is at fault:
// sinks classify errors with this method as unverified epochs.
func (e *UnknownFenceError) Unverified() bool { return true }

// IssuedEpoch is the highest epoch the lease bucket has issued for fence
// id (a partition of its scope, or one of its locks), derived only from
// revisions the server assigned to the fence's lease key. It is 0 when none
// can be shown. It is a bound, not a verification: an epoch below it may
// have been issued to another fence, or to another acquisition. Sinks
// verify a stamp with VerifyAcquisition.
//
//   - While the key holds a lease (a record that decodes and carries the
//     per-message TTL it names), the answer is that lease's epoch, bounded
//     by the record's own revision: no acquisition can be newer than the
//     write in front of it.
//   - Otherwise the key holds a release or expiry marker, a record that is
//     not a lease, or nothing (a marker expired). Its revision, or with
//     nothing the bucket's last revision, bounds every epoch issued so far,
//     and the answer is the highest epoch of the fence record at or below
//     that bound.
//
// What this guarantees: the answer is never above a revision the server
// assigned to the key (or, for a key holding nothing, to the bucket), so no
// record a client writes, in either bucket, can make it exceed them, and no
// epoch above the answer can fence out a live holder or a later one: a live
// holder's epoch is the answer, and a later one's is a newer revision. What
// a credential that may write the lease bucket can still do: write a
// well-formed lease record (with a TTL) over the key, which is a stolen
// lease, a real acquisition whose revision becomes the answer; and, while no
// lease is live, claim in the fence record any epoch up to the marker's
// revision, which a sink may then accept for the fence, refusing what the
// last holder still had in flight. Sinks catch the first as any other
// take-over; neither can hold a future holder off.
//
// A fence the bucket does not serve returns an *UnknownFenceError
// (matching ErrUnknownFence).
func (b *Bucket) IssuedEpoch(ctx context.Context, id leasehold.FenceID) (leasehold.Epoch, error) {
	key, err := b.keyOf(ctx, id)
	if err != nil {
		return 0, err
	}
	return b.issued(ctx, key)
}

func (b *Bucket) issued(ctx context.Context, key string) (leasehold.Epoch, error) {
	live, _, bound, err := b.leaseBound(ctx, key)
	if err != nil || live != 0 {
		return live, err
	}
	rec, _, err := b.readFence(ctx, key)
	if errors.Is(err, errGarbledFence) {
		return 0, nil // shows nothing; Findings reports it
	}
	if err != nil {
		return 0, fmt.Errorf("coordinator: read the fence record %s: %w", key, err)
	}
	var best uint64
	for _, v := range append(rec.Recent, rec.Epoch) {
		if v <= bound && v > best {
			best = v
		}
	}
	return leasehold.Epoch(best), nil
}

// leaseBound reads lease key key through the stream leader. While it
// holds a lease, live is that lease's epoch, which is also the bound, and
// token its acquisition. Otherwise live is 0 and bound is the highest
// revision the server can have assigned to an acquisition of the key so
// far: the revision of the marker or of the record that is not a lease,
// or with nothing there, the bucket's last revision. No record a client
// writes can raise it above a revision the server assigned.
func (b *Bucket) leaseBound(ctx context.Context, key string) (live leasehold.Epoch, token string, bound uint64, err error) {
	e, err := b.last(ctx, key)
	if err != nil {
		return 0, "", 0, fmt.Errorf("coordinator: read %s from the leader of bucket %s: %w", key, b.name, err)
	}
	switch e.kind {
	case entryValue:
		r, foreign := b.leaseRecord(key, e.data, e.header)
		if foreign == "" {
			live = epochOf(r, e.rev)
			return live, r.Token, uint64(live), nil
		}
		return 0, "", e.rev, nil
	case entryMarker:
		return 0, "", e.rev, nil
	}
	bound, err = b.lastRevision(ctx)
	return 0, "", bound, err
}

// leaseRecord decodes a value of lease key key, and says why it is not a
// lease leasehold wrote ("" when it is one).
func (b *Bucket) leaseRecord(key string, data []byte, h nats.Header) (record, string) {
	if strings.HasPrefix(key, partitionKeyPrefix) {
		return partitionReason(data, h)
	}
	return foreignReason(data, h)
}

// lastRevision is the lease bucket's last revision, as its stream leader
// reports it.
func (b *Bucket) lastRevision(ctx context.Context) (uint64, error) {
	s, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		return 0, fmt.Errorf("coordinator: read the last revision of bucket %s: %w", b.name, err)
	}
	return s.CachedInfo().State.LastSeq, nil
}

// keyOf is the lease key of fence id, or an *UnknownFenceError.
func (b *Bucket) keyOf(ctx context.Context, id leasehold.FenceID) (string, error) {
	unknown := func(reason string) error { return &UnknownFenceError{Fence: id, Bucket: b.name, Reason: reason} }
	if id.Scope == b.scope {
		n, err := b.partitionCount(ctx)
		if err != nil {
			var ue *UnknownFenceError
			if errors.As(err, &ue) {
				return "", unknown(ue.Reason)
			}
			return "", err
		}
		if int(id.Partition) >= n {
			return "", unknown(fmt.Sprintf("job stream %s has %d partitions", jobsStream(b.scope), n))
		}
		return partitionKey(id.Partition), nil
	}
	name, ok := strings.CutPrefix(id.Scope, b.scope+"/")
	if !ok {
		return "", unknown(fmt.Sprintf("it serves scope %q and its locks (%q)", b.scope, leasehold.LockScope(b.scope, "<name>")))
	}
	if err := leasehold.ValidateLockName(name); err != nil {
		return "", unknown(err.Error())
	}
	if id.Partition != 0 {
		return "", unknown("a lock's only partition is 0")
	}
	return lockKey(name), nil
}

// Job stream facts the bucket reads: the partition count is recorded in
// the job stream's metadata and never changes.
const metaPartitions = "leasehold.partitions"

func jobsStream(scope string) string { return scope + "-jobs" }

// jobStreamCache keeps the job stream's partition count once known, and a
// missing stream's verdict for a moment, so that a flood of stamps for a
// scope without a job stream costs one lookup a second.
type jobStreamCache struct {
	mu         sync.Mutex
	partitions int
	missing    error
	checked    time.Time
}

const missingJobsRecheck = time.Second

// partitionCount is the partition count of the bucket's job stream, or an
// *UnknownFenceError when there is no job stream to say.
func (b *Bucket) partitionCount(ctx context.Context) (int, error) {
	c := &b.jobs
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.partitions > 0 {
		return c.partitions, nil
	}
	if c.missing != nil && time.Since(c.checked) < missingJobsRecheck {
		return 0, c.missing
	}
	name := jobsStream(b.scope)
	s, err := b.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		c.missing, c.checked = &UnknownFenceError{Bucket: b.name, Reason: "there is no job stream " + name + " to say how many partitions the scope has"}, time.Now()
		return 0, c.missing
	}
	if err != nil {
		return 0, fmt.Errorf("coordinator: look up job stream %s: %w", name, err)
	}
	v := s.CachedInfo().Config.Metadata[metaPartitions]
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > leasehold.MaxPartitions {
		c.missing, c.checked = &UnknownFenceError{Bucket: b.name, Reason: fmt.Sprintf("job stream %s records no partition count (metadata %s=%q)", name, metaPartitions, v)}, time.Now()
		return 0, c.missing
	}
	c.partitions, c.missing = n, nil
	return n, nil
}

// ErrNotIssued is matched by the error VerifyAcquisition returns for an
// epoch and acquisition the lease bucket did not issue to the fence.
var ErrNotIssued = errors.New("coordinator: the lease bucket did not issue this epoch and acquisition to the fence")

// NotIssuedReason says why VerifyAcquisition refused an epoch and
// acquisition.
type NotIssuedReason uint8

const (
	// ReasonAboveIssued: the epoch is above every revision the server has
	// assigned to the fence's lease key (its live lease, its marker) or,
	// with the key empty, to the bucket: it was never issued.
	ReasonAboveIssued NotIssuedReason = iota + 1
	// ReasonOtherWrite: the lease bucket still holds its write at that
	// revision, and it is not an acquisition of this fence: it is another
	// key's (another partition, a lock, a member), or a marker.
	ReasonOtherWrite
	// ReasonOtherAcquisition: the fence record names another acquisition
	// at this epoch. The token is forged, or belongs to the other of two
	// acquisitions handed one revision, which the record refused.
	ReasonOtherAcquisition
	// ReasonNotFenced: no acquisition at this epoch fenced the record: the
	// epoch was issued to another fence, or to an acquisition that never
	// fenced the record and so never had its lease handed out.
	ReasonNotFenced
	// ReasonForgotten: the epoch is older than every acquisition the record
	// remembers (FenceHistory), and at or below one it forgot: it may have
	// been issued, and can no longer be verified.
	ReasonForgotten
	// ReasonUnreadable: the fence record does not decode, so it verifies
	// nothing until `leasehold fence` rewrites it.
	ReasonUnreadable
)

func (r NotIssuedReason) String() string {
	switch r {
	case ReasonAboveIssued:
		return "above_issued"
	case ReasonOtherWrite:
		return "other_write"
	case ReasonOtherAcquisition:
		return "other_acquisition"
	case ReasonNotFenced:
		return "not_fenced"
	case ReasonForgotten:
		return "forgotten"
	case ReasonUnreadable:
		return "unreadable"
	}
	return "unknown"
}

// NotIssuedError reports an epoch and acquisition the lease bucket did not
// issue to a fence, as far as it can show. It is a verdict on the stamp,
// not a failure to reach the bucket: a sink refuses the write as
// unverified rather than retrying it.
type NotIssuedError struct {
	Fence       leasehold.FenceID
	Epoch       leasehold.Epoch
	Acquisition string
	Reason      NotIssuedReason
	Bucket      string
	// Recorded and RecordedAcquisition are the newest acquisition the
	// fence record holds.
	Recorded            leasehold.Epoch
	RecordedAcquisition string
	// Bound is, for ReasonAboveIssued, the highest epoch the lease key's
	// revisions allow.
	Bound leasehold.Epoch
	// Other is, for ReasonOtherAcquisition, the acquisition the record
	// names at Epoch; for ReasonOtherWrite, what the lease bucket's write
	// at revision Epoch is; for ReasonUnreadable, why the record does not
	// decode.
	Other string
	// Oldest is, for ReasonForgotten, the oldest epoch the record
	// remembers.
	Oldest leasehold.Epoch
}

func (e *NotIssuedError) Error() string {
	switch e.Reason {
	case ReasonAboveIssued:
		return fmt.Sprintf("coordinator: epoch %d of %s is above every revision lease bucket %s has assigned to it (%d): it was never issued", e.Epoch, e.Fence, e.Bucket, e.Bound)
	case ReasonOtherWrite:
		return fmt.Sprintf("coordinator: the write at revision %d of lease bucket %s is %s, not an acquisition of %s: epoch %d was issued to another fence", e.Epoch, e.Bucket, e.Other, e.Fence, e.Epoch)
	case ReasonOtherAcquisition:
		return fmt.Sprintf("coordinator: epoch %d of %s was issued to acquisition %s, not %s: the acquisition is forged, or is the other of two handed one revision", e.Epoch, e.Fence, e.Other, e.Acquisition)
	case ReasonForgotten:
		return fmt.Sprintf("coordinator: epoch %d of %s is older than every acquisition its fence record in %s remembers (the oldest is %d; it keeps the last %d): it can no longer be verified", e.Epoch, e.Fence, e.Bucket, e.Oldest, FenceHistory)
	case ReasonUnreadable:
		return fmt.Sprintf("coordinator: the fence record of %s in %s does not decode (%s), so none of its epochs can be verified: `leasehold fence` rewrites it", e.Fence, e.Bucket, e.Other)
	}
	return fmt.Sprintf("coordinator: no acquisition of %s at epoch %d fenced its record in %s (the newest is %d): the epoch was issued to another fence, or never handed out", e.Fence, e.Epoch, e.Bucket, e.Recorded)
}

// Is makes errors.Is(err, ErrNotIssued) true.
func (e *NotIssuedError) Is(target error) bool { return target == ErrNotIssued }

// Unverified reports that the stamp, not the lease bucket, is at fault:
// sinks classify errors with this method as unverified epochs.
func (e *NotIssuedError) Unverified() bool { return true }

// Forgotten reports whether the epoch may have been issued but is older
// than the fence record remembers: sinks refuse it distinctly.
func (e *NotIssuedError) Forgotten() bool { return e.Reason == ReasonForgotten }

// RecordedEpoch is the newest epoch the fence record holds.
func (e *NotIssuedError) RecordedEpoch() leasehold.Epoch { return e.Recorded }

// ErrTokenConflict is matched by the error VerifyAcquisition returns while
// the fence record and the lease bucket name different acquisitions at
// the stamp's epoch.
var ErrTokenConflict = errors.New("coordinator: the fence record and the lease bucket name different acquisitions at one epoch")

// TokenConflictError reports that the fence record names one acquisition
// at an epoch and the lease bucket (its write at that revision, or the
// live lease of that epoch) another, the stamp's being one of them. It is
// not a verdict: a sink does not apply the write and asks again later.
// Either the record was rewritten by something other than an acquisition
// (a credential that may write the fence-record bucket), which may put it
// back, or the lease bucket handed the revision to two acquisitions (it
// lost acknowledged writes), which the next renewal or release of the key
// settles. A stamp verified while the record was rewritten for a moment
// would fence the holder out.
type TokenConflictError struct {
	Fence       leasehold.FenceID
	Epoch       leasehold.Epoch
	Acquisition string // the stamp's
	Recorded    string // the fence record's at Epoch
	Leased      string // the lease bucket's at Epoch
	Bucket      string
}

func (e *TokenConflictError) Error() string {
	return fmt.Sprintf("coordinator: epoch %d of %s: the fence record names acquisition %s and lease bucket %s acquisition %s; the stamp (acquisition %s) is judged once they agree: a record rewritten by something other than an acquisition needs `leasehold fence`, and a revision the lease bucket handed out twice (run NATS with sync_interval: always) settles at the key's next renewal or release",
		e.Epoch, e.Fence, e.Recorded, e.Bucket, e.Leased, e.Acquisition)
}

// Is makes errors.Is(err, ErrTokenConflict) true.
func (e *TokenConflictError) Is(target error) bool { return target == ErrTokenConflict }

// VerifyAcquisition reports whether the lease bucket issued epoch e to
// fence id (a partition of its scope, or one of its locks) for acquisition
// acq. It returns nil when all of these hold:
//
//   - the fence record names (e, acq), as its current acquisition or in
//     its history. The record is the authority on which acquisition an
//     epoch belongs to: it is fenced by compare-and-set on acquisition,
//     before the lease is handed out, so an acquisition that did not fence
//     it never wrote anything, and when the lease bucket handed one
//     revision to two acquisitions (it lost writes) the record names the
//     one that can commit. An epoch the release before recorded without
//     its acquisition is verified by epoch alone;
//   - e is not above what the revisions of the fence's lease key allow
//     (see IssuedEpoch), which no record a client writes can raise;
//   - where the lease bucket still holds its write at revision e (a
//     session-held partition's acquisition stays until it is released),
//     that write is a value of this fence's key.
//
// Epochs from before the lease bucket was re-created are verified by the
// fence record alone: the new bucket's revisions start above them.
//
// An epoch and acquisition that fail a check return a *NotIssuedError
// (matching ErrNotIssued) saying which; a fence the bucket does not serve
// an *UnknownFenceError. Both are verdicts on the stamp. Any other error
// means the bucket did not answer, and says nothing of the stamp.
func (b *Bucket) VerifyAcquisition(ctx context.Context, id leasehold.FenceID, e leasehold.Epoch, acq string) error {
	key, err := b.keyOf(ctx, id)
	if err != nil {
		return err
	}
	// Three reads, all through stream leaders, at once.
	var (
		wg         sync.WaitGroup
		live       leasehold.Epoch
		liveToken  string
		bound      uint64
		rec        fenceRecord
		at         *leader.Msg
		berr, ferr error
		aerr       error
	)
	wg.Go(func() { live, liveToken, bound, berr = b.leaseBound(ctx, key) })
	wg.Go(func() { rec, _, ferr = b.readFence(ctx, key) })
	wg.Go(func() { at, aerr = b.leader.Next(ctx, uint64(e), "") })
	wg.Wait()
	switch {
	case berr != nil:
		return berr
	case ferr != nil && !errors.Is(ferr, errGarbledFence):
		return fmt.Errorf("coordinator: read the fence record %s: %w", key, ferr)
	case aerr != nil:
		return fmt.Errorf("coordinator: read revision %d of bucket %s: %w", e, b.name, aerr)
	}
	ni := &NotIssuedError{Fence: id, Epoch: e, Acquisition: acq, Bucket: b.name,
		Recorded: leasehold.Epoch(rec.Epoch), RecordedAcquisition: rec.Acquisition}
	if uint64(e) > bound {
		ni.Reason, ni.Bound = ReasonAboveIssued, leasehold.Epoch(bound)
		return ni
	}
	// The acquisition the lease bucket itself still shows at revision e:
	// its write there, or the live lease of that epoch.
	var leaseToken string
	if live == e {
		leaseToken = liveToken
	}
	if at != nil && at.Seq == uint64(e) {
		// Next asks for the message at exactly this sequence.
		if other, ok := strings.CutPrefix(at.Subject, b.prefix); !ok || other != key {
			ni.Reason, ni.Other = ReasonOtherWrite, "a write of "+at.Subject
			return ni
		}
		if leader.IsMarker(at.Header) {
			ni.Reason, ni.Other = ReasonOtherWrite, "a release or expiry marker of "+key
			return ni
		}
		if r, foreign := b.leaseRecord(key, at.Data, at.Header); foreign == "" {
			leaseToken = r.Token
		}
	}
	if ferr != nil {
		ni.Reason, ni.Other = ReasonUnreadable, ferr.Error()
		return ni
	}
	h := rec.history()
	for _, f := range h {
		if f.epoch != uint64(e) {
			continue
		}
		switch {
		case f.acquisition != "" && leaseToken != "" && f.acquisition != leaseToken && (acq == f.acquisition || acq == leaseToken):
			// The two buckets disagree on who acquired at e, and the stamp
			// is one of the two. The fence record was rewritten by
			// something other than an acquisition (which may put it back),
			// or the lease bucket handed revision e to two acquisitions
			// (the next renewal or release of the key settles it). Until
			// they agree the stamp is not judged.
			return &TokenConflictError{Fence: id, Epoch: e, Acquisition: acq, Recorded: f.acquisition, Leased: leaseToken, Bucket: b.name}
		case f.acquisition == acq || f.acquisition == "" && (leaseToken == "" || leaseToken == acq):
			return nil
		case f.acquisition == "":
			ni.Reason, ni.Other = ReasonOtherAcquisition, leaseToken
		default:
			ni.Reason, ni.Other = ReasonOtherAcquisition, f.acquisition
		}
		return ni
	}
	if len(h) > 0 && uint64(e) < h[0].epoch && uint64(e) <= rec.forgotten() {
		ni.Reason, ni.Oldest = ReasonForgotten, leasehold.Epoch(h[0].epoch)
		return ni
	}
	ni.Reason = ReasonNotFenced
	return ni
}
