package coordinator

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// The fence-record bucket is the lease bucket's companion: a durable KV
// bucket with no TTL that keeps, per partition and per lock, the epoch and
// acquisition the newest holder fenced, the partition's committed input
// progress and the epochs issued recently. It is what outlives the lease
// bucket: a lease bucket re-created next to it starts its revisions above
// every epoch it recorded, and progress carries over.
//
// Keys are those of the lease bucket: partition.<p> and lock.<name>.

// FenceBucketName is the default name of lease bucket bucket's
// fence-record bucket: "<bucket>-fences".
func FenceBucketName(bucket string) string { return bucket + "-fences" }

// Stream metadata leasehold writes on the two buckets.
const (
	// metaFences, on the lease bucket, names its fence-record bucket. It is
	// set once progress lives there; a lease bucket without it keeps
	// progress in itself, the way leasehold did before.
	metaFences = "leasehold.fences"
	// metaLeaseBucket, on the fence-record bucket, names the lease bucket
	// whose fences it records.
	metaLeaseBucket = "leasehold.lease-bucket"
	metaKind        = "leasehold"
)

// FenceHistory is how many acquisitions a fence record remembers: the
// newest and the ones before it, by epoch and acquisition token. A sink
// that verifies epochs admits an (epoch, acquisition) only while the
// record remembers it, so a sink that reads a log (the stream sink runner)
// refuses, as forgotten, the effects of a holder it reaches only after the
// fence changed hands FenceHistory times or more since. A record of 32
// costs about 1.4 KB (8 remembered 0.4 KB); the release before kept 8
// epochs and no tokens.
const FenceHistory = 32

// recentEpochs is how many epochs a fence record remembers.
const recentEpochs = FenceHistory

// legacyRecent is how many epochs the release before kept in a record,
// with no acquisitions: a record of its that holds that many may have
// forgotten older ones.
const legacyRecent = 8

// fenceRecord is the value of a fence record. JSON keeps it readable with
// `nats kv get`.
type fenceRecord struct {
	// Epoch and Acquisition are those of the newest acquisition that
	// fenced the partition or lock: a holder's Commit is a compare-and-set
	// on the record, so only that acquisition can still change it.
	Epoch       uint64 `json:"epoch"`
	Acquisition string `json:"acquisition,omitempty"`
	// Seq is the last input sequence committed (partitions only): every
	// job up to it is finished.
	Seq uint64 `json:"seq,omitempty"`
	// Done are the jobs above Seq the lease finished (partitions only),
	// encoded by encodeDone; done holds them decoded. A release before
	// kept none: it reads a record with them (it ignores the field) and
	// drops them when it rewrites the record, and its successor runs those
	// jobs again, under the same idempotency keys.
	Done   string   `json:"done,omitempty"`
	done   []uint64 // Done, decoded
	Holder string   `json:"holder"`
	// Recent are the epochs of the latest acquisitions that fenced the
	// record, ascending, Epoch last.
	Recent []uint64 `json:"recent,omitempty"`
	// Acquisitions are the acquisition tokens of Recent's epochs, in the
	// same order; "" for an epoch recorded by the release before, which
	// kept epochs only (such an epoch is verified by epoch alone). A
	// record of that release has none.
	Acquisitions []string `json:"acquisitions,omitempty"`
	// Forgotten is the newest epoch the record no longer remembers: an
	// (epoch, acquisition) at or below it may have fenced the record, and
	// can no longer be verified.
	Forgotten uint64 `json:"forgotten,omitempty"`
}

// fencedBy is one acquisition that fenced a record. An empty acquisition
// is one the release before recorded by epoch alone.
type fencedBy struct {
	epoch       uint64
	acquisition string
}

// highest is the highest epoch r claims.
func (r fenceRecord) highest() uint64 {
	h := r.Epoch
	for _, e := range r.Recent {
		h = max(h, e)
	}
	return h
}

// history is the acquisitions r remembers, ascending by epoch, its current
// one last. The current acquisition is the record's own Epoch and
// Acquisition, whatever Recent says of that epoch.
func (r fenceRecord) history() []fencedBy {
	h := make([]fencedBy, 0, len(r.Recent)+1)
	for i, e := range r.Recent {
		if e == 0 || e >= r.Epoch && r.Epoch != 0 {
			continue
		}
		var a string
		if len(r.Acquisitions) == len(r.Recent) {
			a = r.Acquisitions[i]
		}
		h = append(h, fencedBy{e, a})
	}
	slices.SortFunc(h, func(x, y fencedBy) int { return cmp.Compare(x.epoch, y.epoch) })
	h = slices.CompactFunc(h, func(x, y fencedBy) bool { return x.epoch == y.epoch })
	if r.Epoch != 0 {
		h = append(h, fencedBy{r.Epoch, r.Acquisition})
	}
	return h
}

// forgotten is the newest epoch r no longer remembers: its Forgotten, or,
// for a record of the release before that holds as many epochs as it
// kept, the epoch below its oldest.
func (r fenceRecord) forgotten() uint64 {
	if r.Forgotten != 0 || len(r.Acquisitions) > 0 || len(r.Recent) < legacyRecent {
		return r.Forgotten
	}
	h := r.history()
	if len(h) == 0 {
		return 0
	}
	return h[0].epoch - 1
}

// withEpoch is r fenced by a new acquisition: the acquisitions it
// remembers below e are kept, the latest recentEpochs-1 of them, and
// (e, acquisition) is added last.
func (r fenceRecord) withEpoch(e uint64, acquisition, holder string) fenceRecord {
	forgot := r.forgotten()
	var kept []fencedBy
	for _, f := range r.history() {
		if f.epoch < e {
			kept = append(kept, f)
		}
	}
	if n := len(kept) - (recentEpochs - 1); n > 0 {
		forgot = max(forgot, kept[n-1].epoch)
		kept = kept[n:]
	}
	next := fenceRecord{Epoch: e, Acquisition: acquisition, Seq: r.Seq, Done: r.Done, done: r.done, Holder: holder, Forgotten: forgot,
		Recent: make([]uint64, 0, len(kept)+1), Acquisitions: make([]string, 0, len(kept)+1)}
	for _, f := range append(kept, fencedBy{e, acquisition}) {
		next.Recent = append(next.Recent, f.epoch)
		next.Acquisitions = append(next.Acquisitions, f.acquisition)
	}
	return next
}

// errGarbledFence is matched by errors about a fence record that does not
// decode.
var errGarbledFence = errors.New("fence record is not leasehold's JSON")

func decodeFence(data []byte) (fenceRecord, error) {
	var r fenceRecord
	if err := json.Unmarshal(data, &r); err != nil {
		return fenceRecord{}, fmt.Errorf("%w: %v", errGarbledFence, err)
	}
	if len(r.Acquisitions) > 0 && len(r.Acquisitions) != len(r.Recent) {
		return fenceRecord{}, fmt.Errorf("%w: it names %d acquisitions for %d recent epochs", errGarbledFence, len(r.Acquisitions), len(r.Recent))
	}
	if r.Done != "" {
		done, err := decodeDone(r.Seq, r.Done)
		if err != nil {
			return fenceRecord{}, fmt.Errorf("%w: %v", errGarbledFence, err)
		}
		r.done = done
	}
	return r, nil
}

// readFence reads the fence record key through the fence bucket's stream
// leader. It returns the record and the revision to compare against (0
// when the key holds no message).
func (b *Bucket) readFence(ctx context.Context, key string) (fenceRecord, uint64, error) {
	e, err := lastOf(ctx, b.fenceLeader, b.fencePrefix+key)
	if err != nil {
		return fenceRecord{}, 0, err
	}
	switch e.kind {
	case entryNone:
		return fenceRecord{}, 0, nil
	case entryMarker:
		return fenceRecord{}, e.rev, nil
	}
	r, err := decodeFence(e.data)
	if err != nil {
		return fenceRecord{}, e.rev, fmt.Errorf("%w: key %s of bucket %s: %s", err, key, b.fenceName, fenceFix(key))
	}
	return r, e.rev, nil
}

// fenceFix says how to repair the fence record key.
func fenceFix(key string) string {
	if p, ok := strings.CutPrefix(key, partitionKeyPrefix); ok {
		return "`leasehold fence " + p + "` rewrites it (progress then starts at the job stream's beginning)"
	}
	return "`leasehold fence --lock` on the lock rewrites it"
}

// putFence writes r to the fence record key if the key's last revision is
// expect (0: the key holds no message).
func (b *Bucket) putFence(ctx context.Context, key string, r fenceRecord, expect uint64) (uint64, error) {
	value, err := json.Marshal(r)
	if err != nil {
		return 0, err
	}
	ack, err := b.js.Publish(ctx, b.fencePrefix+key, value, jetstream.WithExpectLastSequencePerSubject(expect))
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// fenceStreamConfig is the stream of a new fence-record bucket: file
// storage, history one, no TTL of any kind, no deletes or purges through
// the stream API, and no rollups (which is how a KV purge works).
func fenceStreamConfig(name, leaseBucket, scope string, replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:               "KV_" + name,
		Description:        "leasehold fence records (epochs and progress) of lease bucket " + leaseBucket,
		Subjects:           []string{"$KV." + name + ".>"},
		MaxMsgsPerSubject:  1,
		MaxMsgs:            -1,
		MaxBytes:           -1,
		MaxMsgSize:         -1,
		MaxConsumers:       -1,
		Storage:            jetstream.FileStorage,
		Replicas:           replicas,
		DenyDelete:         true,
		DenyPurge:          true,
		AllowDirect:        true,
		AllowAtomicPublish: true,
		Discard:            jetstream.DiscardNew,
		Duplicates:         2 * time.Minute,
		Metadata:           map[string]string{metaKind: "fence-records", metaScope: scope, metaLeaseBucket: leaseBucket},
	}
}

// checkFenceStream refuses a fence-record bucket that can lose a record, or
// belongs to another lease bucket, saying what to change.
func checkFenceStream(name, leaseBucket, scope string, c jetstream.StreamConfig, replicas int) error {
	var probs []string
	if c.MaxMsgsPerSubject != 1 {
		probs = append(probs, fmt.Sprintf("history is %d, not 1", c.MaxMsgsPerSubject))
	}
	if c.Storage != jetstream.FileStorage {
		probs = append(probs, "storage is memory, so a server restart would forget every epoch and all progress")
	}
	if c.MaxAge != 0 {
		probs = append(probs, fmt.Sprintf("the bucket TTL is %v, which would expire fence records", c.MaxAge))
	}
	if c.AllowMsgTTL {
		probs = append(probs, "per-message TTLs are allowed, so a record written with one would expire")
	}
	if c.Discard == jetstream.DiscardOld && (c.MaxMsgs > 0 || c.MaxBytes > 0) {
		probs = append(probs, "message or byte limits discard old records")
	}
	if c.Sealed {
		probs = append(probs, "it is sealed")
	}
	if c.Replicas < replicas {
		probs = append(probs, fmt.Sprintf("it has %d replicas and the lease bucket %d: it must be as durable", c.Replicas, replicas))
	}
	if len(probs) > 0 {
		return fmt.Errorf("%w: fence-record bucket %s: %s; copy its records aside, delete it, and let coordinator.Provision (or `leasehold init`) create it",
			ErrBucketConfig, name, strings.Join(probs, "; "))
	}
	if got := c.Metadata[metaLeaseBucket]; got != leaseBucket {
		return fmt.Errorf("%w: bucket %s records the fences of lease bucket %q, not %q: give every lease bucket its own fence-record bucket",
			ErrBucketConfig, name, got, leaseBucket)
	}
	if got := c.Metadata[metaScope]; got != scope {
		return fmt.Errorf("%w: fence-record bucket %s serves scope %q, not %q", ErrBucketConfig, name, got, scope)
	}
	return nil
}

// ensureFenceBucket creates the fence-record bucket, or checks it when it
// exists. created says which.
func ensureFenceBucket(ctx context.Context, js jetstream.JetStream, name, leaseBucket, scope string, replicas int) (created bool, err error) {
	want := fenceStreamConfig(name, leaseBucket, scope, replicas)
	s, err := js.Stream(ctx, want.Name)
	if err == nil {
		return false, checkFenceStream(name, leaseBucket, scope, s.CachedInfo().Config, replicas)
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, fmt.Errorf("coordinator: look up fence-record bucket %s: %w", name, err)
	}
	if _, err := createStream(ctx, js, want); err != nil {
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Another Provision created it a moment ago.
			return ensureFenceBucket(ctx, js, name, leaseBucket, scope, replicas)
		}
		return false, fmt.Errorf("coordinator: create fence-record bucket %s: %w", name, err)
	}
	return true, nil
}

// createStream creates a stream, retrying the moment after a deletion of
// one of the same name, when the server can refuse with "error creating
// store for stream" (API error 10049).
func createStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	var err error
	for attempt := range 10 {
		var s jetstream.Stream
		if s, err = js.CreateStream(ctx, cfg); err == nil {
			return s, nil
		}
		var apiErr *jetstream.APIError
		if !errors.As(err, &apiErr) || apiErr.ErrorCode != 10049 {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-timeAfter(backoff(attempt)):
		}
	}
	return nil, err
}

// fenceFloor reads every record of the fence-record bucket and returns the
// highest epoch any claims, and how many there are. A record that does not
// decode hides its fence's epochs, and one that claims an epoch too high
// for a new bucket to start above it was not written by an acquisition:
// both are refused, naming the record, since no floor above them can be
// known.
func fenceFloor(ctx context.Context, js jetstream.JetStream, name string) (highest leasehold.Epoch, records int, err error) {
	prefix := "$KV." + name + "."
	err = scanLast(ctx, js, "KV_"+name, prefix+">", func(m scanned) error {
		if m.marker {
			return nil
		}
		records++
		key := strings.TrimPrefix(m.subject, prefix)
		r, err := decodeFence(m.data)
		if err != nil {
			return fmt.Errorf("%w: fence record %s of bucket %s (revision %d) does not decode (%v), so the epochs of its fence are not known: repair or remove it, or pass BucketConfig.EpochFloor (`leasehold init --epoch-floor`) above every epoch a sink has recorded",
				ErrBucketConfig, key, name, m.seq, err)
		}
		if h := r.highest(); h > uint64(maxFloor) {
			return fmt.Errorf("%w: fence record %s of bucket %s (revision %d) claims epoch %d, which no lease bucket issues (at most %d): it was forged; repair or remove it before re-creating the lease bucket",
				ErrBucketConfig, key, name, m.seq, h, maxFloor)
		}
		highest = max(highest, leasehold.Epoch(r.highest()))
		return nil
	})
	return highest, records, err
}

// maxFloor is the highest epoch a lease bucket may start above: half the
// epoch range, leaving the other half for its revisions.
const maxFloor = leasehold.MaxEpoch / 2
