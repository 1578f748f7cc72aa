package jspub_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

func TestPublishReturnsTheAck(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
		t.Fatal(err)
	}
	for want := uint64(1); want <= 2; want++ {
		ack, err := jspub.Publish(ctx, js, nats.NewMsg("s.a"), jetstream.WithExpectLastSequence(want-1))
		if err != nil || ack.Sequence != want || ack.Stream != "S" {
			t.Fatalf("publish %d: %+v, %v", want, ack, err)
		}
	}
	// The server's refusal comes back as its API error.
	_, err := jspub.Publish(ctx, js, nats.NewMsg("s.a"), jetstream.WithExpectLastSequence(1))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence {
		t.Fatalf("publish with a wrong last sequence: %v", err)
	}
}

// A request the server received and never answered, because it went away:
// a synchronous publish waits for its whole timeout; Publish returns once
// the client sees the connection drop. The subject has a subscriber that
// never answers, so the test knows the request arrived.
func TestAnswerLostInAServerRestart(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	js := s.JetStream(t)
	hole := make(chan *nats.Msg, 8)
	blackHole(t, s, hole)

	// The baseline: a synchronous publish's answer is lost when the
	// server restarts, and it returns only at its deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	done := make(chan error, 1)
	go func() { _, err := js.PublishMsg(ctx, nats.NewMsg("hole")); done <- err }()
	<-hole
	s.Restart(t)
	if err := <-done; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("synchronous publish across a restart: %v, want its deadline", err)
	}
	cancel()

	// Publish, with a deadline the test never reaches.
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	go func() { _, err := jspub.Publish(ctx, js, nats.NewMsg("hole")); done <- err }()
	<-hole
	s.Restart(t)
	if err := <-done; !errors.Is(err, nats.ErrDisconnected) {
		t.Fatalf("Publish across a restart: %v, want nats.ErrDisconnected", err)
	}
}

// When ctx ends first, the error says it timed out, as a synchronous
// publish's does.
func TestPublishStopsAtItsContext(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := s.JetStream(t)
	hole := make(chan *nats.Msg, 1)
	blackHole(t, s, hole)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := jspub.Publish(ctx, js, nats.NewMsg("hole")); done <- err }()
	<-hole
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) || !errors.Is(err, nats.ErrTimeout) {
		t.Fatalf("Publish after its context ended: %v", err)
	}
	if _, err := jspub.Publish(ctx, js, nats.NewMsg("hole")); !errors.Is(err, context.Canceled) {
		t.Fatalf("Publish with an ended context: %v", err)
	}
}

// blackHole subscribes to "hole" and never answers.
func blackHole(t *testing.T, s *natstest.Server, ch chan *nats.Msg) {
	t.Helper()
	nc := s.Connect(t)
	if _, err := nc.ChanSubscribe("hole", ch); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// An answer lost without the connection dropping (a stream leader that
// stepped down as the request reached it) is asked for again under the
// same message: the second copy is answered. A refusal is not sent again.
func TestPublishRetrySendsAgainWhenAnAnswerIsLost(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := s.JetStream(t)
	nc := s.Connect(t)
	ids := make(chan string, 16)
	seen := 0
	if _, err := nc.Subscribe("lossy", func(m *nats.Msg) {
		ids <- m.Header.Get(jetstream.MsgIDHeader)
		seen++
		if seen > 1 {
			_ = m.Respond([]byte(`{"stream":"S","seq":7}`))
		}
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Subscribe("refused", func(m *nats.Msg) {
		_ = m.Respond([]byte(`{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}}`))
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	msg := nats.NewMsg("lossy")
	msg.Header.Set(jetstream.MsgIDHeader, "once")
	ack, tries, err := jspub.PublishRetry(ctx, js, msg, 100*time.Millisecond)
	if err != nil || ack.Sequence != 7 || tries < 2 {
		t.Fatalf("PublishRetry with its first answer lost: %+v after %d tries, %v", ack, tries, err)
	}
	for range tries {
		if id := <-ids; id != "once" {
			t.Fatalf("a try was sent with Nats-Msg-Id %q, want the message's own", id)
		}
	}

	_, tries, err = jspub.PublishRetry(ctx, js, nats.NewMsg("refused"), 100*time.Millisecond)
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence || tries != 1 {
		t.Fatalf("PublishRetry refused by the server: %v after %d tries, want the API error after 1", err, tries)
	}

	// Unanswered for ever: it stops at its context, saying it timed out.
	hole := make(chan *nats.Msg, 64)
	blackHole(t, s, hole)
	short, cancelShort := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, _, err := jspub.PublishRetry(short, js, nats.NewMsg("hole"), 20*time.Millisecond)
		done <- err
	}()
	<-hole
	<-hole // sent again
	cancelShort()
	if err := <-done; !errors.Is(err, nats.ErrTimeout) {
		t.Fatalf("PublishRetry after its context ended: %v, want nats.ErrTimeout", err)
	}
}
