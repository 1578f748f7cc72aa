package coordinator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// record is the value of a lease key (partition.<p> or member.<worker>).
// JSON keeps it readable with `nats kv get`.
type record struct {
	Holder string `json:"holder"`
	// Token is unique to one acquisition; every renewal repeats it, which is
	// how a holder recognises its own writes after an ambiguous outcome.
	Token string `json:"token"`
	// Epoch is 0 in the acquiring write (its revision is the epoch) and the
	// epoch in every renewal.
	Epoch    uint64    `json:"epoch,omitempty"`
	TTLMilli int64     `json:"ttl_ms"`
	Acquired time.Time `json:"acquired"`
	// Session, in a partition record written under a member session, is
	// the revision that acquired the holder's registration (member.<holder>):
	// the lease lives as long as that registration does, carries no TTL of
	// its own and is never renewed. 0 in a lease that renews itself.
	Session uint64 `json:"session,omitempty"`
	// Holds, in a member registration, lists the partitions the member
	// holds (encodeHolds); nil in a registration that does not advertise
	// them (RenewPartitions, or an earlier version), whose members watch
	// the partition records instead.
	Holds *string `json:"holds,omitempty"`
}

func newToken() string {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return hex.EncodeToString(b[:])
}

// entryKind says what the last message on a key is.
type entryKind int

const (
	entryNone   entryKind = iota // no message on the key
	entryValue                   // a live value
	entryMarker                  // a delete, purge or expiry marker
)

// entry is the last message on a key, as the stream leader sees it.
type entry struct {
	kind   entryKind
	rev    uint64
	data   []byte
	header nats.Header
	time   time.Time
}

// last reads the last message on key through the stream leader. Direct
// gets (what kv.Get uses) may be answered by a follower that is behind, and
// ownership must never be decided from a stale read.
func (b *Bucket) last(ctx context.Context, key string) (entry, error) {
	return lastOf(ctx, b.leader, b.prefix+key)
}

func lastOf(ctx context.Context, r *leader.Reader, subject string) (entry, error) {
	m, err := r.Last(ctx, subject)
	if err != nil {
		return entry{}, err
	}
	if m == nil {
		return entry{kind: entryNone}, nil
	}
	e := entry{kind: entryValue, rev: m.Seq, time: m.Time, data: m.Data, header: m.Header}
	if leader.IsMarker(m.Header) {
		e.kind = entryMarker
	}
	return e, nil
}

// put publishes value to key if the key's last revision is expect (0: the
// key holds no message), with a per-message TTL when ttl > 0.
func (b *Bucket) put(ctx context.Context, key string, value []byte, expect uint64, ttl time.Duration) (uint64, error) {
	opts := []jetstream.PublishOpt{jetstream.WithExpectLastSequencePerSubject(expect)}
	if ttl > 0 {
		opts = append(opts, jetstream.WithMsgTTL(ttl))
	}
	ack, err := b.js.PublishMsg(ctx, &nats.Msg{Subject: b.prefix + key, Data: value}, opts...)
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// purge removes key if its last revision is expect, leaving a marker that
// expires after markerTTL.
func (b *Bucket) purge(ctx context.Context, key string, expect uint64, markerTTL time.Duration) error {
	msg := nats.NewMsg(b.prefix + key)
	msg.Header.Set("KV-Operation", "PURGE")
	msg.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect, 10))
	var opts []jetstream.PublishOpt
	if markerTTL > 0 {
		opts = append(opts, jetstream.WithMsgTTL(markerTTL))
	}
	_, err := b.js.PublishMsg(ctx, msg, opts...)
	return err
}

// isConflict reports whether err is a compare-and-set refusal: the key's
// last revision was not the expected one. R1 streams answer 10071,
// replicated ones mostly 10164; neither is mapped for raw publishes.
func isConflict(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

// isInFlight reports whether err is the refusal a replicated stream
// gives a compare-and-set on a subject whose earlier write is still being
// stored (10164, "wrong last sequence" without a number): reading the key
// at once still shows the revision before that write, so an immediate
// retry is refused the same way. Wait, then read again.
func isInFlight(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

// isRefusal reports whether the server answered err definitively, so the
// write surely did not happen. Anything else (a timeout, a lost connection,
// no responders) leaves the outcome open.
func isRefusal(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr)
}

func decodeRecord(data []byte) (record, error) {
	var r record
	if err := json.Unmarshal(data, &r); err != nil {
		return record{}, fmt.Errorf("lease record is not leasehold's JSON: %w", err)
	}
	if r.Holder == "" || r.Token == "" {
		return record{}, errors.New("lease record has no holder or token")
	}
	return r, nil
}

// epochOf returns the epoch of the lease whose last write is at revision
// rev. A renewal repeats the epoch its acquisition got, and no acquisition
// can have a revision above the write in front of us: an epoch the record
// claims beyond rev is bounded by rev.
func epochOf(r record, rev uint64) leasehold.Epoch {
	if r.Epoch != 0 && r.Epoch < rev {
		return leasehold.Epoch(r.Epoch)
	}
	return leasehold.Epoch(rev)
}

// foreignReason says why the value of a lease key (a partition, lock or
// member record) is not a lease leasehold wrote, or "" when it is one: it
// must decode, and carry the per-message TTL its own ttl_ms names, or the
// server would never expire it and it would hold the key for ever.
func foreignReason(data []byte, h nats.Header) (record, string) {
	r, err := decodeRecord(data)
	if err != nil {
		return record{}, err.Error()
	}
	ttl, ok := messageTTL(h)
	switch {
	case !ok:
		return r, "the record carries no per-message TTL, so the server would never expire it"
	case r.TTLMilli <= 0 || ttl != time.Duration(r.TTLMilli)*time.Millisecond:
		return r, fmt.Sprintf("the record's per-message TTL (%v) is not the %dms it names", ttl, r.TTLMilli)
	}
	return r, ""
}

// messageTTL reads the Nats-TTL header the way the server does: a Go
// duration or whole seconds, "never" meaning none. ok is false when the
// message has no TTL that would expire it.
func messageTTL(h nats.Header) (time.Duration, bool) {
	v := h.Get(jetstream.MsgTTLHeader)
	if v == "" || strings.EqualFold(v, "never") {
		return 0, false
	}
	if d, err := time.ParseDuration(v); err == nil {
		d = d.Truncate(time.Second)
		return d, d >= time.Second
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 || n > math.MaxInt64/int64(time.Second) {
		return 0, false
	}
	return time.Duration(n) * time.Second, true
}

// timeAfter is time.After; a variable so that backoff waits read the same
// everywhere.
var timeAfter = time.After
