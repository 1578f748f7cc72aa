package main

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// One value without a stamp (a `nats kv put` by hand) must not hide every
// other value from `sink ls`: the listing is how an operator finds it.
func TestSinkLsWithAnUnstampedValue(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 60*time.Second)
	js := s.JetStream(t)
	if _, err := kvsink.New(ctx, js, kvsink.Config{Bucket: kvsink.DefaultBucket, Name: "kvs"}); err != nil {
		t.Fatal(err)
	}
	st := leasehold.Stamp{Scope: "leasehold", Partition: 0, Epoch: 7, Acquisition: "a1", Key: "good", Worker: "w1"}
	h := nats.Header{}
	st.SetHeader(h)
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "$KV." + kvsink.DefaultBucket + ".good", Data: []byte("v"), Header: h}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "$KV."+kvsink.DefaultBucket+".bare", []byte("by hand")); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, ctx, "sink", "ls", "--nats", s.URL())
	if err != nil || !strings.Contains(out, "good") || !strings.Contains(out, "key bare: ") {
		t.Errorf("sink ls with one unstamped value: %v\n%s", err, out)
	}
	out, err = run(t, ctx, "sink", "ls", "--json", "--nats", s.URL())
	if err != nil || !strings.Contains(out, `"key": "good"`) || !strings.Contains(out, `"unreadable"`) {
		t.Errorf("sink ls --json with one unstamped value: %v\n%s", err, out)
	}
}
