// Package kvsink is a leasehold sink that writes effects into a JetStream
// key-value bucket: Effect.Subject is the key, Effect.Data the value, and
// the stamp (scope, partition, epoch, acquisition, key, worker) travels in
// the entry's headers, beside the effect's W3C trace context and nothing
// else.
//
// Check and write are one atomic step on the server. Each fence (a scope
// and a partition) has a fence key holding its state as JSON, {"epoch",
// "acquisition", "holder"}, and each applied (scope, idempotency key) a
// dedupe key:
//
//	_leasehold.fence.<scope token>.<partition>
//	_leasehold.dedupe.<hex SHA-256 of scope, a NUL byte, key>
//
// The scope token is the scope with every byte other than letters, digits,
// '-', '_' and '/' written as '=' and two upper-case hex digits ("orders"
// stays "orders", "billing/account:42" becomes "billing/account=3A42"), so
// it is one KV key token and distinct scopes never share a key. A dedupe
// key's value is the bytes it is the hash of.
//
// Apply publishes one atomic batch (JetStream atomic batch publish, server
// 2.12 or later): the fence key of every fence involved, written only if
// its revision is still the one the sink read, then for each effect its
// dedupe key, written only if it does not exist yet, and its value. Each
// effect is judged with leasehold.Judge against its fence as the earlier
// effects of the batch leave it. The server applies the whole batch or
// none of it; when another writer moved a fence or applied a key first,
// the sink reads again and decides again. So an effect lands only under
// the fence it was judged against, a batch of effects is all-or-nothing,
// and fences of different scopes never touch each other.
//
// Buckets written before fence scopes hold _leasehold.fence.<partition>
// and _leasehold.key.<hex SHA-256 of key>. Config.LegacyScope adopts them
// as one scope's: see its documentation. Without it, New refuses such a
// bucket.
//
// New creates the bucket when it is missing, with atomic publish allowed.
// Read effects back with Get, or with any KV client.
package kvsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// DefaultBucket is the bucket's name when none is configured.
const DefaultBucket = "leasehold-sink"

// Config configures a Sink.
type Config struct {
	// Bucket is the KV bucket. Default DefaultBucket.
	Bucket string
	// Replicas of a bucket New creates: 1 for development, 3 in
	// production. Default 1.
	Replicas int
	// DedupeTTL is how long dedupe keys live; a key repeated after that is
	// applied again. Default 0: they live as long as the bucket.
	DedupeTTL time.Duration
	// RequestTimeout bounds one request to the server. Default 5s.
	RequestTimeout time.Duration
	// LegacyScope is the scope that wrote the records of a bucket written
	// before fence scopes, normally the job stream's prefix. The sink then
	// takes them as that scope's: a fence of the scope whose key holds
	// nothing is read from the partition's record of before, and its first
	// write (Apply or Advance) writes the scoped key, compare-and-set
	// against that record, and replaces the record with a "moved to" text
	// that a sink built before fence scopes cannot read, so that it stops
	// instead of fencing against a record nobody moves any more. The keys
	// applied before stay applied for the scope: an effect of the scope
	// needs both its dedupe key and the one of before to be absent, in the
	// same atomic batch. Values written before read back with this scope
	// and no acquisition. Keep it set for as long as the bucket holds
	// records of before. Default "": New refuses a bucket that holds any.
	LegacyScope string
	// MinReplicas is the fewest replicas the bucket may have: set it to the
	// lease bucket's, since a sink that loses a fence record (a lost disk
	// of a single replica) admits the writes the record refused. Default 0:
	// no floor beyond one replica.
	MinReplicas int
	// Name names the sink in decisions and logs. Default "kv".
	Name string
	// Verifier, when set, turns on verified epochs (see sink.EpochCheck).
	Verifier sink.Verifier
	// Observer receives every decision. Optional.
	Observer sink.Observer
	// Logger receives rate-limited drop lines. Default slog.Default().
	Logger *slog.Logger
	// Telemetry selects the providers of the sink's spans and metrics (see
	// sink.Reporter). Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

func (c *Config) setDefaults() {
	if c.Bucket == "" {
		c.Bucket = DefaultBucket
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 5 * time.Second
	}
	if c.Name == "" {
		c.Name = "kv"
	}
}

// Validate reports every problem with c.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if !validKey(c.Bucket) || strings.Contains(c.Bucket, ".") {
		errs = append(errs, fmt.Errorf("bucket %q: use letters, digits, '-' and '_'", c.Bucket))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("replicas %d: use 1, 3 or 5", c.Replicas))
	}
	if c.DedupeTTL < 0 || c.DedupeTTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("dedupe TTL %v: use whole seconds, or 0 to keep keys", c.DedupeTTL))
	}
	if c.RequestTimeout <= 0 {
		errs = append(errs, fmt.Errorf("request timeout %v must be positive", c.RequestTimeout))
	}
	if c.MinReplicas < 0 || c.MinReplicas > 5 {
		errs = append(errs, fmt.Errorf("min replicas %d: use 0 to 5", c.MinReplicas))
	}
	if c.LegacyScope != "" {
		if err := leasehold.ValidateScope(c.LegacyScope); err != nil {
			errs = append(errs, fmt.Errorf("legacy scope %q: %w", c.LegacyScope, err))
		}
	}
	return errors.Join(errs...)
}

// Sink is a fenced KV sink. It is safe for concurrent use.
type Sink struct {
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	cfg    Config
	stream string
	prefix string // "$KV.<bucket>."
	leader *leader.Reader
	rep    *sink.Reporter
	check  *sink.EpochCheck

	mu     sync.Mutex
	fences map[leasehold.FenceID]fence // last seen; never above the server's
}

var _ sink.Sink = (*Sink)(nil)

// ErrLegacyRecords is matched by the error New returns for a bucket
// written before fence scopes when Config.LegacyScope is not set.
var ErrLegacyRecords = errors.New("kvsink: the bucket holds fence records written before fence scopes")

// New binds to the bucket, creating it when it is missing, and checks that
// it allows atomic batches and, unless Config.LegacyScope is set, that it
// holds no records written before fence scopes.
func New(ctx context.Context, js jetstream.JetStream, cfg Config) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("kvsink: invalid config: %w", err)
	}
	cfg.setDefaults()
	stream := "KV_" + cfg.Bucket
	lookup := func(ctx context.Context) (jetstream.Stream, error) { return js.Stream(ctx, stream) }
	info, err := retry.Value(ctx, lookup)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		err = retry.Do(ctx, func(ctx context.Context) error {
			_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
				Bucket:      cfg.Bucket,
				Description: "leasehold fenced effects",
				History:     1,
				Storage:     jetstream.FileStorage,
				Replicas:    cfg.Replicas,
			})
			return err
		})
		if err != nil && !errors.Is(err, jetstream.ErrBucketExists) {
			return nil, fmt.Errorf("kvsink: create bucket %s: %w", cfg.Bucket, err)
		}
		info, err = retry.Value(ctx, lookup)
	}
	if err != nil {
		return nil, fmt.Errorf("kvsink: look up bucket %s: %w", cfg.Bucket, err)
	}
	sc := info.CachedInfo().Config
	if !sc.AllowAtomicPublish || (cfg.DedupeTTL > 0 && !sc.AllowMsgTTL) {
		sc.AllowAtomicPublish = true
		sc.AllowMsgTTL = sc.AllowMsgTTL || cfg.DedupeTTL > 0
		if err := retry.Do(ctx, func(ctx context.Context) error { _, err := js.UpdateStream(ctx, sc); return err }); err != nil {
			return nil, fmt.Errorf("kvsink: bucket %s does not allow atomic batches and could not be changed to (it needs nats-server 2.12 or later): %w", cfg.Bucket, err)
		}
	}
	if sc.MaxMsgsPerSubject != 1 {
		return nil, fmt.Errorf("kvsink: bucket %s keeps a history of %d; the sink needs a history of 1: use another bucket", cfg.Bucket, sc.MaxMsgsPerSubject)
	}
	if err := checkDurable(cfg, sc); err != nil {
		return nil, err
	}
	kv, err := retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) { return js.KeyValue(ctx, cfg.Bucket) })
	if err != nil {
		return nil, fmt.Errorf("kvsink: bind bucket %s: %w", cfg.Bucket, err)
	}
	s := &Sink{
		js: js, kv: kv, cfg: cfg, stream: stream, prefix: "$KV." + cfg.Bucket + ".", leader: leader.NewReader(js, stream),
		rep:    sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check:  sink.NewEpochCheck(cfg.Verifier),
		fences: make(map[leasehold.FenceID]fence),
	}
	if cfg.LegacyScope == "" {
		key, err := s.legacyKey(ctx)
		if err != nil {
			return nil, fmt.Errorf("kvsink: bucket %s: look for records written before fence scopes: %w", cfg.Bucket, err)
		}
		if key != "" {
			return nil, fmt.Errorf("%w (%s in bucket %s): set Config.LegacyScope to the scope that wrote them, normally the job stream's prefix, so that its fences and applied keys carry on; or use a fresh bucket",
				ErrLegacyRecords, key, cfg.Bucket)
		}
	}
	return s, nil
}

// maxLegacyMarkers bounds the deleted legacy keys New steps over; past it,
// it takes the bucket to hold legacy records, which errs on the side of
// keeping their fences.
const maxLegacyMarkers = 1000

// legacyKey returns a fence or dedupe key of the bucket written before
// fence scopes, or "" when it holds none. A wildcard matches one token, so
// the filters see none of the scoped keys.
func (s *Sink) legacyKey(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	markers := 0
	for _, filter := range []string{s.prefix + fencePrefix + "*", s.prefix + legacyDedupePrefix + "*"} {
		for seq := uint64(1); ; {
			m, err := s.leader.Next(ctx, seq, filter)
			if err != nil {
				return "", err
			}
			if m == nil {
				break
			}
			if !leader.IsMarker(m.Header) || markers >= maxLegacyMarkers {
				return strings.TrimPrefix(m.Subject, s.prefix), nil
			}
			markers++
			seq = m.Seq + 1
		}
	}
	return "", nil
}

// KeyValue is the bucket, for reading and watching effects.
func (s *Sink) KeyValue() jetstream.KeyValue { return s.kv }

// MaxBatch is the most effects one Apply takes.
const MaxBatch = maxEffects

// Get reads the effect last applied to subject, with its stamp, from the
// stream leader. Its Header holds the stamp and the trace context the
// effect carried.
func (s *Sink) Get(ctx context.Context, subject string) (sink.Effect, bool, error) {
	m, err := s.last(ctx, subject)
	if err != nil || m.kind != entryValue {
		return sink.Effect{}, false, err
	}
	st, err := s.stampOf(m.header)
	if err != nil {
		return sink.Effect{}, false, fmt.Errorf("kvsink: key %s: %w", subject, err)
	}
	h := make(map[string][]string, len(m.header))
	for k, vs := range m.header {
		if keepHeader(k) || isStampHeader(k) {
			h[k] = vs
		}
	}
	return sink.Effect{Stamp: st, Subject: subject, Data: m.data, Header: h}, true, nil
}

// stampOf reads a value's stamp. A value written before fence scopes has
// neither scope nor acquisition: with a legacy scope it reads as that
// scope's, with no acquisition.
func (s *Sink) stampOf(h nats.Header) (leasehold.Stamp, error) {
	st, err := leasehold.StampFromHeader(h)
	if err == nil || s.cfg.LegacyScope == "" || hasHeader(h, leasehold.HeaderScope) || hasHeader(h, leasehold.HeaderAcquisition) {
		return st, err
	}
	c := make(map[string][]string, len(h)+2)
	for k, vs := range h {
		c[k] = vs
	}
	c[leasehold.HeaderScope] = []string{s.cfg.LegacyScope}
	c[leasehold.HeaderAcquisition] = []string{"legacy"}
	st, err = leasehold.StampFromHeader(c)
	st.Acquisition = ""
	return st, err
}

func hasHeader(h nats.Header, name string) bool {
	for k := range h {
		if strings.EqualFold(k, name) {
			return true
		}
	}
	return false
}

// Effects reads every applied effect in the bucket. It is meant for
// tests and tools: it lists the keys through the stream leader (a KV key
// listing may be served by a replica that is behind) and reads them one at
// a time.
func (s *Sink) Effects(ctx context.Context) ([]sink.Effect, error) {
	str, err := s.js.Stream(ctx, s.stream)
	if err != nil {
		return nil, fmt.Errorf("kvsink: list keys: %w", err)
	}
	info, err := str.Info(ctx, jetstream.WithSubjectFilter(s.prefix+">"))
	if err != nil {
		return nil, fmt.Errorf("kvsink: list keys: %w", err)
	}
	var keys []string
	for subj := range info.State.Subjects {
		if k := strings.TrimPrefix(subj, s.prefix); !strings.HasPrefix(k, internalPrefix) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var out []sink.Effect
	for _, k := range keys {
		e, ok, err := s.Get(ctx, k)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, e)
		}
	}
	return out, nil
}

// ErrUnsafeBucket is matched by the error New returns for a bucket that
// can lose a fence record: a sink that forgets a fence admits the writes it
// refused (measured: a fence of 100 gone to 0 after a restart of a memory
// bucket, and a write of epoch 50 applied).
var ErrUnsafeBucket = errors.New("kvsink: bucket can lose fence records")

// checkDurable refuses a bucket that can lose a record on its own: memory
// storage, a bucket TTL, limits that discard old records, or fewer
// replicas than asked for.
func checkDurable(cfg Config, sc jetstream.StreamConfig) error {
	var probs []string
	if sc.Storage != jetstream.FileStorage {
		probs = append(probs, "its storage is memory, so a server restart forgets every fence")
	}
	if sc.MaxAge > 0 {
		probs = append(probs, fmt.Sprintf("its TTL is %v, which expires fence records", sc.MaxAge))
	}
	if sc.Discard == jetstream.DiscardOld && (sc.MaxBytes > 0 || sc.MaxMsgs > 0) {
		probs = append(probs, "it is bounded and discards old records when full, fence records among them")
	}
	if floor := max(cfg.MinReplicas, 1); sc.Replicas < floor {
		probs = append(probs, fmt.Sprintf("it has %d replicas and the lease bucket has %d: a lost disk would lose fences the lease bucket still remembers", sc.Replicas, floor))
	}
	if len(probs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: bucket %s: %s; give the sink a bucket with file storage, no TTL and no discard of old records (kvsink.New creates one)",
		ErrUnsafeBucket, cfg.Bucket, strings.Join(probs, "; "))
}
