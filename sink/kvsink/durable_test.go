package kvsink_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A bucket that can lose a fence record is refused, saying why: memory
// storage, a TTL, old records discarded when full, fewer replicas than the
// lease bucket's.
func TestBucketThatCanLoseFencesRefused(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	ctx := ctxFor(t, time.Minute)
	for _, c := range []struct {
		name string
		kv   jetstream.KeyValueConfig
		min  int
		say  string
	}{
		{"memory", jetstream.KeyValueConfig{Bucket: "mem", History: 1, Storage: jetstream.MemoryStorage}, 0, "storage is memory"},
		{"ttl", jetstream.KeyValueConfig{Bucket: "ttl", History: 1, TTL: time.Hour}, 0, "TTL"},
		{"replicas", jetstream.KeyValueConfig{Bucket: "one", History: 1}, 3, "replicas"},
	} {
		if _, err := js.CreateKeyValue(ctx, c.kv); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		_, err := kvsink.New(ctx, js, kvsink.Config{Bucket: c.kv.Bucket, MinReplicas: c.min, Logger: quiet()})
		if !errors.Is(err, kvsink.ErrUnsafeBucket) || !strings.Contains(err.Error(), c.say) {
			t.Errorf("%s: New = %v, want ErrUnsafeBucket saying %q", c.name, err, c.say)
		}
	}
	if _, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "fresh", Logger: quiet()}); err != nil {
		t.Fatalf("a bucket New creates: %v", err)
	}
}
