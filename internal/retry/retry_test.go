package retry_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

func TestTransient(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&jetstream.APIError{Code: 500, ErrorCode: 10049, Description: "error creating store for stream"}, true},
		{&jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}, true},
		{&jetstream.APIError{Code: 500, ErrorCode: 10009, Description: "JetStream cluster can not handle request"}, true},
		{fmt.Errorf("create: %w", &jetstream.APIError{ErrorCode: 10118}), true},
		{nats.ErrNoResponders, true},
		{jetstream.ErrJetStreamNotEnabled, true},
		{nats.ErrTimeout, true},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), true},
		{&jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use with a different configuration"}, false},
		{&jetstream.APIError{Code: 404, ErrorCode: 10059, Description: "stream not found"}, false},
		{jetstream.ErrStreamNameAlreadyInUse, false},
		{context.Canceled, false},
		{errors.New("something else"), false},
		{nil, false},
	} {
		if got := retry.Transient(c.err); got != c.want {
			t.Errorf("Transient(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// A transient answer that does not go away ends in a *GaveUpError that
// wraps it; any other error ends the retry at once, as it is.
func TestBound(t *testing.T) {
	t.Parallel()
	transient := &jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}
	p := retry.Policy{For: 200 * time.Millisecond, First: time.Millisecond, Max: 10 * time.Millisecond}
	attempts := 0
	err := p.Do(context.Background(), func(context.Context) error { attempts++; return transient })
	var gave *retry.GaveUpError
	if !errors.As(err, &gave) || !errors.Is(err, transient) || gave.Attempts != attempts || attempts < 2 {
		t.Fatalf("after %d attempts: %v", attempts, err)
	}
	t.Logf("%v", err)

	attempts = 0
	final := &jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use with a different configuration"}
	if err := p.Do(context.Background(), func(context.Context) error { attempts++; return final }); err != final || attempts != 1 {
		t.Fatalf("a final answer was retried (%d attempts) or changed: %v", attempts, err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.Do(ctx, func(context.Context) error { return transient }); !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled context: %v", err)
	}
}

// The lease bucket's stream deleted and created again in a tight loop: the
// server answers some creates with 10049 while the old store is still
// being removed (seen with the race detector on a loaded machine; an idle
// machine rarely shows it), and every create still succeeds through Do.
func TestCreateRightAfterDelete(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cfg := jetstream.StreamConfig{
		Name: "KV_B", Subjects: []string{"$KV.B.>"}, MaxMsgsPerSubject: 1, Storage: jetstream.FileStorage,
		AllowRollup: true, AllowDirect: true, AllowMsgTTL: true, SubjectDeleteMarkerTTL: time.Minute,
	}
	var store atomic.Int64
	p := retry.Policy{OnRetry: func(_ int, err error, _ time.Duration) {
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == 10049 {
			store.Add(1)
		}
	}}
	const rounds = 150
	for i := range rounds {
		if err := p.Do(ctx, func(ctx context.Context) error { _, err := js.CreateStream(ctx, cfg); return err }); err != nil {
			t.Fatalf("round %d: create: %v", i, err)
		}
		if _, err := js.Publish(ctx, "$KV.B.k", []byte("v"), jetstream.WithMsgTTL(time.Second)); err != nil {
			t.Fatalf("round %d: put: %v", i, err)
		}
		if err := js.DeleteStream(ctx, cfg.Name); err != nil {
			t.Fatalf("round %d: delete: %v", i, err)
		}
	}
	t.Logf("%d of %d creates were answered with 10049 at first and retried", store.Load(), rounds)
}

// While the server is down, and while it is starting, a create gets no
// responders, disconnection or timeouts; Do carries it over the restart.
func TestCreateAcrossARestart(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	js := srv.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	natstest.WaitJetStream(t, js, time.Minute)
	srv.Shutdown()
	failed := make(chan error, 1)
	p := retry.Policy{For: time.Minute, OnRetry: func(_ int, err error, _ time.Duration) {
		select {
		case failed <- err:
		default:
		}
	}}
	done := make(chan error, 1)
	go func() {
		done <- p.Do(ctx, func(ctx context.Context) error {
			_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}})
			return err
		})
	}()
	select {
	case err := <-failed:
		t.Logf("while the server is down: %v", err)
	case <-ctx.Done():
		t.Fatal("gave up waiting for a create to fail while the server was down")
	}
	srv.Restart(t)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("create across the restart: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("gave up waiting for the create to succeed after the restart")
	}
}
