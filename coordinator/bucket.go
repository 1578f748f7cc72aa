package coordinator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/retry"
)

// DefaultBucket is the lease bucket's name when none is configured.
const DefaultBucket = "leasehold-leases"

// BucketConfig describes the lease bucket Provision creates, and its
// fence-record bucket.
type BucketConfig struct {
	// Bucket is the KV bucket name. Default DefaultBucket.
	Bucket string
	// Scope is the fencing scope the bucket's leases issue epochs for: the
	// prefix of the job stream whose partitions it leases, and the
	// namespace of the locks it holds (a lock's scope is
	// "<scope>/<name>"). It is recorded in the bucket and outlives it: a
	// bucket re-created with the same scope continues its fences. Letters,
	// digits, '-' and '_'. Default: the bucket's name without a "-leases"
	// suffix ("orders-leases" serves "orders").
	Scope string
	// FenceBucket names the fence-record bucket: the durable KV bucket
	// that keeps each partition's and lock's fenced epoch and each
	// partition's committed progress, and outlives the lease bucket.
	// Default FenceBucketName(Bucket), "<bucket>-fences".
	FenceBucket string
	// Replicas is the replica count of both buckets: 1 for development, 3
	// in production. Default 1.
	Replicas int
	// MarkerTTL is how long release and expiry markers stay in the bucket.
	// Default one minute; at least one second.
	MarkerTTL time.Duration
	// EpochFloor is an epoch a new lease bucket's revisions must start
	// above. A new bucket always starts above the current time in Unix
	// microseconds and above every epoch its fence-record bucket recorded;
	// EpochFloor is for when those records are gone too: pass the highest
	// epoch any sink has recorded for the bucket's scope.
	EpochFloor leasehold.Epoch
	// RestartProgress accepts that every partition's progress starts again
	// at the beginning of the job stream, when Provision finds that the
	// fence records (which hold progress) are gone while the job stream
	// has been used. Without it Provision refuses. The jobs the stream
	// still holds run again; sinks that dedupe apply their effects once
	// only within their dedupe window.
	RestartProgress bool

	// Logger receives what Provision changed: a bucket created, progress
	// records moved. Default slog.Default().
	Logger *slog.Logger
}

func (c *BucketConfig) setDefaults() {
	if c.Bucket == "" {
		c.Bucket = DefaultBucket
	}
	if c.Scope == "" {
		c.Scope = DefaultScope(c.Bucket)
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.MarkerTTL == 0 {
		c.MarkerTTL = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports whether c describes a bucket Provision can create.
func (c BucketConfig) Validate() error {
	c.setDefaults()
	var errs []error
	if !validToken(c.Bucket, false) {
		errs = append(errs, fmt.Errorf("bucket name %q: use letters, digits, '-' and '_' only", c.Bucket))
	}
	if c.FenceBucket != "" && (!validToken(c.FenceBucket, false) || c.FenceBucket == c.Bucket) {
		errs = append(errs, fmt.Errorf("fence-record bucket name %q: use letters, digits, '-' and '_' only, and not the lease bucket's name", c.FenceBucket))
	}
	if !validToken(c.Scope, false) || len(c.Scope) > 64 {
		errs = append(errs, fmt.Errorf("scope %q: use letters, digits, '-' and '_' only, at most 64 (it is the job stream's prefix)", c.Scope))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("replicas %d: use 1 for development or 3 (or 5) in production", c.Replicas))
	}
	if c.MarkerTTL < time.Second || c.MarkerTTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("marker TTL %v: use whole seconds, at least 1s", c.MarkerTTL))
	}
	if c.EpochFloor > maxFloor {
		errs = append(errs, fmt.Errorf("epoch floor %d leaves no room below %d", c.EpochFloor, leasehold.MaxEpoch))
	}
	return errors.Join(errs...)
}

// DefaultScope is the scope of a bucket named bucket when none is given:
// the name without a "-leases" suffix.
func DefaultScope(bucket string) string {
	if s, ok := strings.CutSuffix(bucket, "-leases"); ok && s != "" {
		return s
	}
	return bucket
}

// metaScope is the stream metadata key that records a lease bucket's scope.
const metaScope = "leasehold.scope"

// Bucket is a lease bucket, with its fence-record bucket, that has been
// checked to give leasehold's guarantees.
type Bucket struct {
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	name   string
	scope  string
	stream string
	prefix string // "$KV.<bucket>."
	leader *leader.Reader

	fences      jetstream.KeyValue
	fenceName   string
	fenceStream string
	fencePrefix string // "$KV.<fence bucket>."
	fenceLeader *leader.Reader

	markerTTL time.Duration // how long release markers stay
	// atomic says both buckets take atomic batches, which acquisitions
	// use when they can (batch.go).
	atomic bool

	jobs jobStreamCache
}

// ErrBucketConfig is matched by errors about a lease bucket that cannot
// give leasehold's guarantees.
var ErrBucketConfig = errors.New("coordinator: lease bucket cannot give leasehold's guarantees")

// OpenBucket binds to an existing lease bucket and its fence-record
// bucket, and checks both.
func OpenBucket(ctx context.Context, js jetstream.JetStream, bucket string) (*Bucket, error) {
	if bucket == "" {
		bucket = DefaultBucket
	}
	return open(ctx, js, bucket, 0)
}

func open(ctx context.Context, js jetstream.JetStream, bucket string, replicas int) (*Bucket, error) {
	s, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) { return js.Stream(ctx, "KV_"+bucket) })
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("coordinator: lease bucket %s does not exist: create it with coordinator.Provision or `leasehold init`", bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("coordinator: look up lease bucket %s: %w", bucket, err)
	}
	sc := s.CachedInfo().Config
	if err := checkStream(bucket, sc, replicas); err != nil {
		return nil, err
	}
	scope := sc.Metadata[metaScope]
	if scope == "" {
		return nil, fmt.Errorf("%w: bucket %s records no scope (it was created by an earlier leasehold): run `leasehold init` (or coordinator.Provision) once with its job stream's prefix to upgrade it in place",
			ErrBucketConfig, bucket)
	}
	fenceName := sc.Metadata[metaFences]
	if fenceName == "" {
		return nil, fmt.Errorf("%w: bucket %s keeps progress records in itself (it was created by an earlier leasehold): run `leasehold init` (or coordinator.Provision) once to move them to its fence-record bucket",
			ErrBucketConfig, bucket)
	}
	fs, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) { return js.Stream(ctx, "KV_"+fenceName) })
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("%w: the fence-record bucket %s of lease bucket %s is missing, and with it every partition's progress: run `leasehold init` (coordinator.Provision) to find out how to go on",
			ErrBucketConfig, fenceName, bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("coordinator: look up fence-record bucket %s: %w", fenceName, err)
	}
	fsc := fs.CachedInfo().Config
	if err := checkFenceStream(fenceName, bucket, scope, fsc, sc.Replicas); err != nil {
		return nil, err
	}
	kv, err := retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) { return js.KeyValue(ctx, bucket) })
	if err != nil {
		return nil, fmt.Errorf("coordinator: bind lease bucket %s: %w", bucket, err)
	}
	fkv, err := js.KeyValue(ctx, fenceName)
	if err != nil {
		return nil, fmt.Errorf("coordinator: bind fence-record bucket %s: %w", fenceName, err)
	}
	return &Bucket{
		js:     js,
		kv:     kv,
		name:   bucket,
		scope:  scope,
		stream: "KV_" + bucket,
		prefix: "$KV." + bucket + ".",
		leader: leader.NewReader(js, "KV_"+bucket),

		fences:      fkv,
		fenceName:   fenceName,
		fenceStream: "KV_" + fenceName,
		fencePrefix: "$KV." + fenceName + ".",
		fenceLeader: leader.NewReader(js, "KV_"+fenceName),

		markerTTL: sc.SubjectDeleteMarkerTTL,
		atomic:    sc.AllowAtomicPublish && fsc.AllowAtomicPublish,
	}, nil
}

// checkStream refuses a bucket that cannot give the guarantees, saying what
// to change.
func checkStream(bucket string, c jetstream.StreamConfig, replicas int) error {
	var probs []string
	if c.MaxMsgsPerSubject != 1 {
		probs = append(probs, fmt.Sprintf("history is %d, and per-key TTLs need a history of 1", c.MaxMsgsPerSubject))
	}
	if !c.AllowMsgTTL || c.SubjectDeleteMarkerTTL <= 0 {
		probs = append(probs, "per-key TTLs with limit markers are off (the bucket needs a limit marker TTL), so an abandoned lease would never expire")
	}
	if c.Storage != jetstream.FileStorage {
		probs = append(probs, "storage is memory, so a server restart would forget every lease and restart epochs")
	}
	if c.MaxAge != 0 {
		probs = append(probs, fmt.Sprintf("the bucket TTL is %v, which would expire progress records", c.MaxAge))
	}
	if !c.AllowRollup {
		probs = append(probs, "rollups are off, so a lease cannot be released")
	}
	if c.FirstSeq <= 1 {
		probs = append(probs, "it was created without a first-sequence floor, so its epochs would restart at 1 if it were deleted and re-created")
	}
	if c.Sealed {
		probs = append(probs, "it is sealed")
	}
	if replicas > 0 && c.Replicas < replicas {
		probs = append(probs, fmt.Sprintf("it has %d replicas and %d were asked for", c.Replicas, replicas))
	}
	if len(probs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: bucket %s: %s; move its data aside, delete it, and let coordinator.Provision (or `leasehold init`) create it",
		ErrBucketConfig, bucket, strings.Join(probs, "; "))
}

// Name is the bucket name.
func (b *Bucket) Name() string { return b.name }

// Scope is the fencing scope the bucket issues epochs for: its job
// stream's prefix, and the namespace of its locks.
func (b *Bucket) Scope() string { return b.scope }

// FenceBucket is the name of the fence-record bucket.
func (b *Bucket) FenceBucket() string { return b.fenceName }

// FenceRecords is the fence-record bucket as a jetstream.KeyValue, for
// reading.
func (b *Bucket) FenceRecords() jetstream.KeyValue { return b.fences }

// KeyValue is the bucket as a jetstream.KeyValue, for watching.
func (b *Bucket) KeyValue() jetstream.KeyValue { return b.kv }

// Lookup reads key through the stream leader, for a decision a lagging
// replica must not make: kv.Get is a direct get, which a follower behind
// the leader may answer with an older value, or none. ok is false when the
// key holds no value (never written, deleted or expired).
func (b *Bucket) Lookup(ctx context.Context, key string) (value []byte, ok bool, err error) {
	e, err := b.last(ctx, key)
	if err != nil {
		return nil, false, fmt.Errorf("coordinator: read %s from the leader of bucket %s: %w", key, b.name, err)
	}
	if e.kind != entryValue {
		return nil, false, nil
	}
	return e.data, true, nil
}

// Key names in the bucket.
const (
	partitionKeyPrefix = "partition."
	memberKeyPrefix    = "member."
	lockKeyPrefix      = "lock."
	// noticeKeyPrefix names the notices Fence, or a take-over of an
	// unlisted record, leaves a worker whose session-held partition it
	// removed (see notice.go): notice.<worker>.<partition>.
	noticeKeyPrefix = "notice."
	// progressKeyPrefix names the progress records an earlier leasehold
	// kept in the lease bucket; Provision moves them out.
	progressKeyPrefix = "progress."
)

func partitionKey(p leasehold.Partition) string { return partitionKeyPrefix + p.String() }
func progressKey(p leasehold.Partition) string  { return progressKeyPrefix + p.String() }
func memberKey(worker string) string            { return memberKeyPrefix + worker }

// noticeKey is the key of worker's notices about partition p: one key a
// partition, as a watch shows only the last of several writes to one key
// that land together.
func noticeKey(worker string, p leasehold.Partition) string {
	return noticeKeyPrefix + worker + "." + p.String()
}

// noticeFilter matches every notice to worker.
func noticeFilter(worker string) string { return noticeKeyPrefix + worker + ".>" }

// isNoticeTo reports whether key is a notice to worker.
func isNoticeTo(key, worker string) bool {
	rest, ok := strings.CutPrefix(key, noticeKeyPrefix+worker+".")
	return ok && rest != ""
}

// validToken reports whether s can be one token of a NATS subject and a KV
// key: letters, digits, '-', '_' (and '.' separated tokens when dots is set).
func validToken(s string, dots bool) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
		case c == '.' && dots && i > 0 && i < len(s)-1 && s[i-1] != '.':
		default:
			return false
		}
	}
	return true
}
