package httpsink

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// KVKeysConfig configures a KVKeys store.
type KVKeysConfig struct {
	// Bucket holds the keys. Default "leasehold-http-keys". New creates it
	// when it is missing: file storage, history 1, per-key TTLs.
	Bucket string
	// Replicas of the bucket New creates. Default 1.
	Replicas int
	// RequestTimeout bounds one request. Default 5s.
	RequestTimeout time.Duration
}

// KVKeys keeps idempotency keys in a JetStream KV bucket, one entry per
// key ("k.<hex SHA-256 of the key>") holding its fingerprint, status and
// claim token. A claim is a create that succeeds only if the entry does
// not exist, with a TTL of the hold; Done is a compare-and-set on the
// claim's revision that sets the status and a TTL of the keep; Release a
// compare-and-set purge. The server expires entries itself (per-key TTLs,
// NATS 2.11 or later), whole seconds, at least one.
type KVKeys struct {
	js      jetstream.JetStream
	kv      jetstream.KeyValue
	subject string // "$KV.<bucket>."
	timeout time.Duration
}

// NewKVKeys opens the bucket, creating it when it is missing.
func NewKVKeys(ctx context.Context, js jetstream.JetStream, cfg KVKeysConfig) (*KVKeys, error) {
	if cfg.Bucket == "" {
		cfg.Bucket = "leasehold-http-keys"
	}
	if cfg.Replicas == 0 {
		cfg.Replicas = 1
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = 5 * time.Second
	}
	kv, err := js.KeyValue(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: cfg.Bucket, History: 1, Storage: jetstream.FileStorage, Replicas: cfg.Replicas,
			LimitMarkerTTL: time.Second, Description: "leasehold http verifier idempotency keys",
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = js.KeyValue(ctx, cfg.Bucket)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("httpsink: key bucket %s: %w", cfg.Bucket, err)
	}
	if st, err := kv.Status(ctx); err == nil && st.LimitMarkerTTL() == 0 {
		return nil, fmt.Errorf("httpsink: key bucket %s has no per-key TTLs (LimitMarkerTTL): its keys would never expire; delete it, or give another", cfg.Bucket)
	}
	return &KVKeys{js: js, kv: kv, subject: "$KV." + cfg.Bucket + ".", timeout: cfg.RequestTimeout}, nil
}

type kvKey struct {
	Key    string `json:"key"`
	Sum    string `json:"sum"`
	Status int    `json:"status"`
	Token  string `json:"token"`
}

func kvKeyName(key string) string {
	s := sha256.Sum256([]byte(key))
	return "k." + hex.EncodeToString(s[:])
}

// ttlOf rounds d up to whole seconds, at least one: the server's unit.
func ttlOf(d time.Duration) time.Duration {
	return max(time.Second, (d + time.Second - 1).Truncate(time.Second))
}

// Claim implements Keys.
func (k *KVKeys) Claim(ctx context.Context, key string, sum [32]byte, hold time.Duration) (Claim, error) {
	name := kvKeyName(key)
	token := newToken()
	val, _ := json.Marshal(kvKey{Key: key, Sum: hex.EncodeToString(sum[:]), Token: token})
	var last error
	for attempt := 0; attempt < 5; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, k.timeout)
		rev, err := k.kv.Create(cctx, name, val, jetstream.KeyTTL(ttlOf(hold)))
		cancel()
		if err == nil {
			return Claim{Key: key, Won: true, Sum: sum, Token: strconv.FormatUint(rev, 10) + ":" + token}, nil
		}
		if !errors.Is(err, jetstream.ErrKeyExists) && !conflict(err) {
			return Claim{}, fmt.Errorf("httpsink: claim idempotency key: %w", err)
		}
		gctx, cancel := context.WithTimeout(ctx, k.timeout)
		e, err := k.kv.Get(gctx, name)
		cancel()
		if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
			last = err // expired or released in between: claim again
			continue
		}
		if err != nil {
			return Claim{}, fmt.Errorf("httpsink: read idempotency key: %w", err)
		}
		var got kvKey
		if err := json.Unmarshal(e.Value(), &got); err != nil || got.Key != key {
			return Claim{}, fmt.Errorf("httpsink: the key bucket's entry %s is not this store's: %v", name, err)
		}
		c := Claim{Key: key, Status: got.Status, Token: strconv.FormatUint(e.Revision(), 10) + ":" + got.Token}
		if b, err := hex.DecodeString(got.Sum); err == nil && len(b) == 32 {
			copy(c.Sum[:], b)
		}
		return c, nil
	}
	return Claim{}, fmt.Errorf("httpsink: claim idempotency key: it kept changing: %w", last)
}

// Done implements Keys.
func (k *KVKeys) Done(ctx context.Context, c Claim, status int, keep time.Duration) error {
	rev, token, err := splitToken(c.Token)
	if err != nil {
		return err
	}
	val, _ := json.Marshal(kvKey{Key: c.Key, Sum: hex.EncodeToString(c.Sum[:]), Status: status, Token: token})
	cctx, cancel := context.WithTimeout(ctx, k.timeout)
	defer cancel()
	_, err = k.js.PublishMsg(cctx, &nats.Msg{Subject: k.subject + kvKeyName(c.Key), Data: val},
		jetstream.WithExpectLastSequencePerSubject(rev), jetstream.WithMsgTTL(ttlOf(keep)))
	if conflict(err) {
		return fmt.Errorf("%w: %w", ErrClaimLost, err)
	}
	return err
}

// Release implements Keys.
func (k *KVKeys) Release(ctx context.Context, c Claim) error {
	rev, _, err := splitToken(c.Token)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, k.timeout)
	defer cancel()
	err = k.kv.Purge(cctx, kvKeyName(c.Key), jetstream.LastRevision(rev), jetstream.PurgeTTL(time.Second))
	if conflict(err) || errors.Is(err, jetstream.ErrKeyExists) {
		return fmt.Errorf("%w: %w", ErrClaimLost, err)
	}
	return err
}

func splitToken(t string) (uint64, string, error) {
	r, tok, ok := strings.Cut(t, ":")
	rev, err := strconv.ParseUint(r, 10, 64)
	if !ok || err != nil || rev == 0 {
		return 0, "", fmt.Errorf("httpsink: claim token %q is not this store's", t)
	}
	return rev, tok, nil
}

// conflict reports whether err is a compare-and-set refusal: JetStream
// answers 10071 on one replica and mostly 10164 on three, unmapped for raw
// publishes.
func conflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == 10071 || apiErr.ErrorCode == 10164)
}
