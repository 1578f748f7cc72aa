package streamsink_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// pullWorld is a runner on its own log, with a handler that records the
// keys it applies, and a forger: a plain NATS client that listens to the
// consumer's pull requests to learn the inbox the runner's deliveries
// come to, and publishes to it.
type pullWorld struct {
	js      jetstream.JetStream
	r       *running
	prefix  string
	inbox   chan string // the reply subjects of the runner's pull requests
	forger  *nats.Conn
	mu      sync.Mutex
	applied []string
	applies chan struct{}
}

func newPullWorld(t *testing.T, prefix string, cfg streamsink.Config) *pullWorld {
	t.Helper()
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	pw := &pullWorld{js: js, prefix: prefix, inbox: make(chan string, 1024), applies: make(chan struct{}, 1)}
	// The server's refusals of what the forger sends are the forger's
	// business: not printed.
	pw.forger = srv.Connect(t, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	// The forger listens before the runner sends its first pull.
	sub, err := pw.forger.Subscribe("$JS.API.CONSUMER.MSG.NEXT.>", func(m *nats.Msg) {
		select {
		case pw.inbox <- m.Reply:
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := pw.forger.Flush(); err != nil {
		t.Fatal(err)
	}
	cfg.Prefix, cfg.Provision, cfg.Logger = prefix, true, quiet()
	if cfg.AckWait == 0 {
		// Longer than the test: a delivery lost on the way comes back only
		// if something hands it back.
		cfg.AckWait = 10 * time.Minute
	}
	cfg.Handler = func(_ context.Context, e sink.Effect) error {
		pw.mu.Lock()
		pw.applied = append(pw.applied, e.Stamp.Key)
		pw.mu.Unlock()
		select {
		case pw.applies <- struct{}{}:
		default:
		}
		return nil
	}
	pw.r = start(t, js, cfg)
	return pw
}

// pullInbox returns the inbox of the runner's pull requests.
func (pw *pullWorld) pullInbox(t *testing.T, ctx context.Context) string {
	t.Helper()
	select {
	case in := <-pw.inbox:
		if in == "" {
			t.Fatal("a pull request without a reply subject")
		}
		return in
	case <-ctx.Done():
		t.Fatal("the forger saw no pull request")
		return ""
	}
}

func (pw *pullWorld) publish(t *testing.T, ctx context.Context, key string) uint64 {
	t.Helper()
	return publishStamped(t, ctx, pw.js, pw.prefix+".out.x", pw.prefix, 3, key, false)
}

func (pw *pullWorld) keys() []string {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	return slices.Clone(pw.applied)
}

// forgeDelivery publishes to the runner's inbox a message that looks like
// a delivery of the consumer at log position seq: its reply subject is an
// ack subject of the consumer's, which is where a delivery's metadata is
// read from. It carries a well-formed stamp of the log's scope and key.
func (pw *pullWorld) forgeDelivery(t *testing.T, inbox string, seq uint64, key string) {
	t.Helper()
	h := nats.Header{}
	leasehold.Stamp{Scope: pw.prefix, Epoch: 3, Acquisition: "a3", Key: key, Worker: "w3"}.SetHeader(h)
	reply := fmt.Sprintf("$JS.ACK.%s-effects.%s-sink.1.%d.%d.%d.0", pw.prefix, pw.prefix, seq, seq, time.Now().UnixNano())
	if err := pw.forger.PublishMsg(&nats.Msg{Subject: inbox, Reply: reply, Header: h, Data: []byte(key)}); err != nil {
		t.Fatal(err)
	}
	if err := pw.forger.Flush(); err != nil {
		t.Fatal(err)
	}
}

// A client that can publish to the runner's inbox (any client, unless
// the account's permissions say otherwise) sends it a message with an ack
// subject of the consumer's as its reply, naming the log position the
// next real effect will take. The runner must not apply what is not in
// its log, and must not let the forgery take the place of the real effect
// stored at that position: that effect belongs to a committed job, and a
// runner that takes the position for handled acks it without applying it.
//
// What stops it today is the server: nats-server (2.15 here) refuses a
// client's publish whose reply subject starts with $JS.ACK., and the
// runner reads a delivery's position from that reply subject alone. The
// test keeps the pair honest: a server, or a runner, that lets the
// forgery through fails it.
func TestForgedDeliveryIsNotApplied(t *testing.T) {
	t.Parallel()
	ctx := ctxFor(t, time.Minute)
	pw := newPullWorld(t, "atkpulldeliv", streamsink.Config{})
	inbox := pw.pullInbox(t, ctx)
	first := pw.publish(t, ctx, "before")
	if err := pw.r.WaitPosition(ctx, first); err != nil {
		t.Fatal(err)
	}
	pw.forgeDelivery(t, inbox, first+1, "forged")
	// The forgery reaches the runner before the real message does: the
	// real one is published once the forger's connection has flushed, and
	// both go through the same server to the same subscription; the
	// runner's ack of the forgery (if it takes it) is not awaited.
	real := pw.publish(t, ctx, "real")
	if real != first+1 {
		t.Fatalf("the real effect took position %d, not %d", real, first+1)
	}
	after := pw.publish(t, ctx, "after")
	if err := pw.r.WaitPosition(ctx, after); err != nil {
		t.Fatal(err)
	}
	got := pw.keys()
	if slices.Contains(got, "forged") {
		t.Errorf("the runner applied a forged delivery that is not in its log: applied %v", got)
	}
	if !slices.Contains(got, "real") {
		t.Errorf("the real effect at log position %d was never applied (a forged delivery took its place): applied %v", real, got)
	}
}

// The forger names a position far past the log's end. The runner must
// neither stop at a gap nobody made (an operator who resumes past it
// skips every real effect stored there later) nor take the position as
// handled (it would ack those effects without applying them).
func TestForgedDeliveryFarAheadMovesNothing(t *testing.T) {
	t.Parallel()
	ctx := ctxFor(t, time.Minute)
	pw := newPullWorld(t, "atkpullfar", streamsink.Config{})
	inbox := pw.pullInbox(t, ctx)
	first := pw.publish(t, ctx, "before")
	if err := pw.r.WaitPosition(ctx, first); err != nil {
		t.Fatal(err)
	}
	pw.forgeDelivery(t, inbox, first+50, "forged")
	var last uint64
	for i := range 60 {
		last = pw.publish(t, ctx, fmt.Sprintf("real%d", i))
	}
	wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	err := pw.r.WaitPosition(wctx, last)
	got := pw.keys()
	if err != nil {
		t.Fatalf("the runner did not reach position %d after a forged delivery at %d: at %d, Ready = %v", last, first+50, pw.r.Position(), pw.r.Ready(ctx))
	}
	if slices.Contains(got, "forged") {
		t.Errorf("the runner applied a forged delivery that is not in its log")
	}
	for i := range 60 {
		if !slices.Contains(got, fmt.Sprintf("real%d", i)) {
			t.Errorf("real%d (log position %d) was never applied", i, first+1+uint64(i))
		}
	}
}
