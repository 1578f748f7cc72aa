package coordinator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
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
}

// progressRecord is the value of progress.<p>: the last input sequence
// committed for the partition and the epoch it was committed under.
type progressRecord struct {
	Epoch  uint64 `json:"epoch"`
	Seq    uint64 `json:"seq"`
	Holder string `json:"holder"`
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
	kind entryKind
	rev  uint64
	data []byte
	time time.Time
}

// last reads the last message on key through the stream leader. Direct
// gets (what kv.Get uses) may be answered by a follower that is behind, and
// ownership must never be decided from a stale read.
func (b *Bucket) last(ctx context.Context, key string) (entry, error) {
	m, err := b.leader.Last(ctx, b.prefix+key)
	if err != nil {
		return entry{}, err
	}
	if m == nil {
		return entry{kind: entryNone}, nil
	}
	e := entry{kind: entryValue, rev: m.Seq, time: m.Time, data: m.Data}
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

// epochOf returns the epoch of the lease whose last write is e.
func epochOf(r record, rev uint64) leasehold.Epoch {
	if r.Epoch != 0 {
		return leasehold.Epoch(r.Epoch)
	}
	return leasehold.Epoch(rev)
}

// timeAfter is time.After; a variable so that backoff waits read the same
// everywhere.
var timeAfter = time.After
