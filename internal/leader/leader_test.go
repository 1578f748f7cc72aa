package leader_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

func TestLastAndNext(t *testing.T) {
	t.Parallel()
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

// A read whose request the server never answers — written just before the
// server went away — ends at the connection's default timeout, even when
// the caller's context has no deadline, and the next read, after the
// reconnect, is answered. Before this bound a stream sink runner sent such
// a read 43 ms after a server restart and waited for its answer for good,
// while the connection was healthy again: a sink that applied nothing more.
func TestReadLostInARestartEnds(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	proxy := natstest.NewProxy(t, srv.URL())
	nc, err := nats.Connect(proxy.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.Timeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithDefaultTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.a", []byte("a")); err != nil {
		t.Fatal(err)
	}
	r := leader.NewReader(js, "S")

	proxy.Freeze()
	type result struct {
		m   *leader.Msg
		err error
	}
	lost := make(chan result, 1)
	go func() {
		m, err := r.Last(context.Background(), "s.a") // no deadline of its own
		lost <- result{m, err}
	}()
	awaitCond(t, ctx, "the proxy to hold the read request", func() bool { return proxy.Holding() > 0 })
	srv.Restart(t) // the held request dies with the old server's connection
	proxy.Thaw()

	select {
	case res := <-lost:
		if res.err == nil {
			t.Fatalf("a read the server never received was answered: %+v", res.m)
		}
		t.Logf("the lost read ended: %v", res.err)
	case <-ctx.Done():
		t.Fatal("the read whose request was lost in the server restart never returned: it waits for an answer that cannot come")
	}
	awaitCond(t, ctx, "the client to reconnect", nc.IsConnected)
	var m *leader.Msg
	awaitCond(t, ctx, "a read after the reconnect to be answered", func() bool {
		m, err = r.Last(ctx, "s.a")
		return err == nil
	})
	if m == nil || string(m.Data) != "a" {
		t.Fatalf("read after the reconnect: %+v", m)
	}
}

// awaitCond checks cond every 10ms until it holds, failing with what was
// awaited when ctx ends first.
func awaitCond(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("gave up waiting for %s: %v", what, ctx.Err())
		case <-tick.C:
		}
	}
}
