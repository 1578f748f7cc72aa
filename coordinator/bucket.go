package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/retry"
)

// DefaultBucket is the lease bucket's name when none is configured.
const DefaultBucket = "leasehold-leases"

// BucketConfig describes the lease bucket Provision creates.
type BucketConfig struct {
	// Bucket is the KV bucket name. Default DefaultBucket.
	Bucket string
	// Replicas is the stream's replica count: 1 for development, 3 in
	// production. Default 1.
	Replicas int
	// MarkerTTL is how long release and expiry markers stay in the bucket.
	// Default one minute; at least one second.
	MarkerTTL time.Duration
	// EpochFloor is an epoch the new bucket's revisions must start above,
	// for example the highest epoch a sink has recorded. Provision always
	// starts a new bucket at the current time in Unix microseconds or
	// above, which keeps it above any earlier bucket that issued fewer than
	// a million revisions a second on average; EpochFloor covers the rest.
	EpochFloor leasehold.Epoch
}

func (c *BucketConfig) setDefaults() {
	if c.Bucket == "" {
		c.Bucket = DefaultBucket
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.MarkerTTL == 0 {
		c.MarkerTTL = time.Minute
	}
}

// Validate reports whether c describes a bucket Provision can create.
func (c BucketConfig) Validate() error {
	c.setDefaults()
	var errs []error
	if !validToken(c.Bucket, false) {
		errs = append(errs, fmt.Errorf("bucket name %q: use letters, digits, '-' and '_' only", c.Bucket))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("replicas %d: use 1 for development or 3 (or 5) in production", c.Replicas))
	}
	if c.MarkerTTL < time.Second || c.MarkerTTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("marker TTL %v: use whole seconds, at least 1s", c.MarkerTTL))
	}
	if c.EpochFloor > leasehold.MaxEpoch/2 {
		errs = append(errs, fmt.Errorf("epoch floor %d leaves no room below %d", c.EpochFloor, leasehold.MaxEpoch))
	}
	return errors.Join(errs...)
}

// Bucket is a lease bucket that has been checked to give leasehold's
// guarantees.
type Bucket struct {
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	name   string
	stream string
	prefix string // "$KV.<bucket>."
	leader *leader.Reader

	markerTTL time.Duration // how long release markers stay
}

// ErrBucketConfig is matched by errors about a lease bucket that cannot
// give leasehold's guarantees.
var ErrBucketConfig = errors.New("coordinator: lease bucket cannot give leasehold's guarantees")

// Provision creates the lease bucket if it does not exist and checks it if
// it does. A new bucket gets per-key TTLs with limit markers, a history of
// one, file storage and a first sequence above every earlier bucket's.
func Provision(ctx context.Context, js jetstream.JetStream, cfg BucketConfig) (*Bucket, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	stream := "KV_" + cfg.Bucket
	if _, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) { return js.Stream(ctx, stream) }); err == nil {
		return open(ctx, js, cfg.Bucket, cfg.Replicas)
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("coordinator: look up lease bucket %s: %w", cfg.Bucket, err)
	}
	first := uint64(time.Now().UnixMicro())
	if f := uint64(cfg.EpochFloor) + 1; f > first {
		first = f
	}
	sc := jetstream.StreamConfig{
		Name:                   stream,
		Description:            "leasehold leases, members and fenced progress",
		Subjects:               []string{"$KV." + cfg.Bucket + ".>"},
		MaxMsgsPerSubject:      1,
		MaxMsgs:                -1,
		MaxBytes:               -1,
		MaxMsgSize:             -1,
		MaxConsumers:           -1,
		Storage:                jetstream.FileStorage,
		Replicas:               cfg.Replicas,
		AllowRollup:            true,
		DenyDelete:             true,
		AllowDirect:            true,
		Discard:                jetstream.DiscardNew,
		Duplicates:             2 * time.Minute,
		AllowMsgTTL:            true,
		SubjectDeleteMarkerTTL: cfg.MarkerTTL,
		FirstSeq:               first,
		Metadata:               map[string]string{"leasehold": "lease-bucket"},
	}
	// Right after a delete of the same bucket the server may refuse the
	// create for a moment (10049).
	err := retry.Do(ctx, func(ctx context.Context) error { _, err := js.CreateStream(ctx, sc); return err })
	if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return nil, fmt.Errorf("coordinator: create lease bucket %s: %w", cfg.Bucket, err)
	}
	return open(ctx, js, cfg.Bucket, cfg.Replicas)
}

// OpenBucket binds to an existing lease bucket and checks it.
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
	if err := checkStream(bucket, s.CachedInfo().Config, replicas); err != nil {
		return nil, err
	}
	kv, err := retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) { return js.KeyValue(ctx, bucket) })
	if err != nil {
		return nil, fmt.Errorf("coordinator: bind lease bucket %s: %w", bucket, err)
	}
	return &Bucket{
		js:     js,
		kv:     kv,
		name:   bucket,
		stream: "KV_" + bucket,
		prefix: "$KV." + bucket + ".",
		leader: leader.NewReader(js, "KV_"+bucket),

		markerTTL: s.CachedInfo().Config.SubjectDeleteMarkerTTL,
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
	progressKeyPrefix  = "progress."
)

func partitionKey(p leasehold.Partition) string { return partitionKeyPrefix + p.String() }
func progressKey(p leasehold.Partition) string  { return progressKeyPrefix + p.String() }
func memberKey(worker string) string            { return memberKeyPrefix + worker }

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
