package leader_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestLastAndNext(t *testing.T) {
	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, AllowDirect: true}); err != nil {
		t.Fatal(err)
	}
	r := leader.NewReader(js, "S")
	if m, err := r.Last(ctx, "s.a"); err != nil || m != nil {
		t.Fatalf("empty subject: %v, %v", m, err)
	}
	for _, subj := range []string{"s.a", "s.b", "s.a"} {
		msg := nats.NewMsg(subj)
		msg.Header.Set("X", subj)
		msg.Data = []byte(subj)
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	m, err := r.Last(ctx, "s.a")
	if err != nil || m == nil || m.Seq != 3 || string(m.Data) != "s.a" || m.Header.Get("X") != "s.a" || m.Time.IsZero() {
		t.Fatalf("last of s.a: %+v, %v", m, err)
	}
	if m, err := r.Next(ctx, 2, "s.a"); err != nil || m == nil || m.Seq != 3 {
		t.Fatalf("next s.a from 2: %+v, %v", m, err)
	}
	if m, err := r.Next(ctx, 4, ""); err != nil || m != nil {
		t.Fatalf("past the end: %+v, %v", m, err)
	}
	if _, err := leader.NewReader(js, "missing").Last(ctx, "x"); err == nil {
		t.Fatal("a missing stream read as empty")
	}
	if !leader.IsMarker(nats.Header{"KV-Operation": {"PURGE"}}) || !leader.IsMarker(nats.Header{jetstream.MarkerReasonHeader: {"MaxAge"}}) || leader.IsMarker(nil) {
		t.Fatal("IsMarker")
	}
	if p := leader.APIPrefix(jetstream.JetStreamOptions{Domain: "hub"}); p != "$JS.hub.API." {
		t.Fatalf("domain prefix %q", p)
	}
}
