// Package kvsink is a leasehold sink that writes effects into a JetStream
// key-value bucket: Effect.Subject is the key, Effect.Data the value, and
// the stamp travels in the entry's headers.
//
// Check and write are one atomic step on the server. Each partition has a
// fence key (_leasehold.fence.<p>) holding its recorded maximum, and each
// applied idempotency key a dedupe key (_leasehold.key.<sha256>). Apply
// publishes one atomic batch (JetStream atomic batch publish, server 2.12
// or later): the fence key of every partition involved, written only if
// its revision is still the one the sink read, then for each effect its
// dedupe key, written only if it does not exist yet, and its value. The
// server applies the whole batch or none of it; when another writer moved
// a fence or applied a key first, the sink reads again and decides again.
// So an effect lands only under the fence it was judged against, and a
// batch of effects is all-or-nothing.
//
// New creates the bucket when it is missing, with atomic publish allowed.
// Read effects back with Get, or with any KV client.
package kvsink

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// DefaultBucket is the bucket's name when none is configured.
const DefaultBucket = "leasehold-sink"

// Prefix of the sink's own keys in the bucket. Effect subjects must not
// start with it.
const internalPrefix = "_leasehold."

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
	fences map[leasehold.Partition]fence // last seen; never above the server's
}

var _ sink.Sink = (*Sink)(nil)

// fence is a fence key's value and revision.
type fence struct {
	Epoch  leasehold.Epoch `json:"epoch"`
	Holder string          `json:"holder,omitempty"`
	rev    uint64
}

// New binds to the bucket, creating it when it is missing, and checks that
// it allows atomic batches.
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
	kv, err := retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) { return js.KeyValue(ctx, cfg.Bucket) })
	if err != nil {
		return nil, fmt.Errorf("kvsink: bind bucket %s: %w", cfg.Bucket, err)
	}
	return &Sink{
		js: js, kv: kv, cfg: cfg, stream: stream, prefix: "$KV." + cfg.Bucket + ".", leader: leader.NewReader(js, stream),
		rep:    sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check:  sink.NewEpochCheck(cfg.Verifier),
		fences: make(map[leasehold.Partition]fence),
	}, nil
}

// KeyValue is the bucket, for reading and watching effects.
func (s *Sink) KeyValue() jetstream.KeyValue { return s.kv }

// Dropped returns how many effects of partition p were refused.
func (s *Sink) Dropped(p leasehold.Partition) uint64 { return s.rep.Dropped(p) }

func fenceKey(p leasehold.Partition) string { return internalPrefix + "fence." + p.String() }

func dedupeKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return internalPrefix + "key." + hex.EncodeToString(sum[:])
}

// validKey mirrors the KV key rules: letters, digits and -/_=., with no
// empty token.
func validKey(k string) bool {
	if k == "" || k[0] == '.' || k[len(k)-1] == '.' || strings.Contains(k, "..") {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("-/_=.", c) >= 0) {
			return false
		}
	}
	return true
}

// ErrBadSubject is matched by the error for an effect whose subject is
// not a key the sink can write.
var ErrBadSubject = errors.New("kvsink: effect subject is not a usable key")

func checkSubject(e *sink.Effect) error { return CheckKey(e.Subject) }

// CheckKey returns an error matching ErrBadSubject when key cannot be an
// effect's subject (its KV key), and nil when it can.
func CheckKey(key string) error {
	if !validKey(key) {
		return fmt.Errorf("%w: %q: use letters, digits and -/_=. (dot-separated, no empty part)", ErrBadSubject, key)
	}
	if strings.HasPrefix(key, internalPrefix) {
		return fmt.Errorf("%w: %q: keys starting with %s are the sink's own", ErrBadSubject, key, internalPrefix)
	}
	return nil
}

// MaxBatch is the most effects one Apply takes.
const MaxBatch = maxEffects

// Get reads the effect last applied to subject, with its stamp, from the
// stream leader.
func (s *Sink) Get(ctx context.Context, subject string) (sink.Effect, bool, error) {
	m, err := s.last(ctx, subject)
	if err != nil || m.kind != entryValue {
		return sink.Effect{}, false, err
	}
	st, err := leasehold.StampFromHeader(m.header)
	if err != nil {
		return sink.Effect{}, false, fmt.Errorf("kvsink: key %s: %w", subject, err)
	}
	return sink.Effect{Stamp: st, Subject: subject, Data: m.data, Header: m.header}, true, nil
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

func decodeFence(m entry) (fence, error) {
	f := fence{rev: m.rev}
	if m.kind != entryValue {
		return f, nil
	}
	if err := json.Unmarshal(m.data, &f); err != nil {
		return fence{}, fmt.Errorf("kvsink: fence key %s holds %q, which is not leasehold's JSON: %w", m.subject, m.data, err)
	}
	f.rev = m.rev
	return f, nil
}
