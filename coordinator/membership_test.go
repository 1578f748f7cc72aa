package coordinator_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
)

// A second process under a worker ID another live process holds stops at
// once with an error naming the ID and how to give another, instead of
// waiting for ever for a registration that is renewed for ever. The
// first is not disturbed. (The TTL is long: the second must learn it
// from the first's renewals, not from any expiry.)
func TestDuplicateWorkerIDFailsFast(t *testing.T) {
	t.Parallel()
	const n = 4
	_, b := startBucket(t)
	first := startMemberTTL(t, b, "twin", n, 30*time.Second)
	waitFor(t, 20*time.Second, "the first twin holds the partitions", func() bool { return len(first.c.Held()) == n })

	second, err := coordinator.New(b, coordinator.Config{Worker: "twin", Partitions: n, TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, 25*time.Second) // below the TTL: no expiry can end the wait
	err = second.Run(ctx)
	var taken *coordinator.WorkerIDTakenError
	if !errors.As(err, &taken) || !errors.Is(err, coordinator.ErrWorkerIDTaken) || ctx.Err() != nil {
		t.Fatalf("the second twin's Run: %v; want a *WorkerIDTakenError before its context ended", err)
	}
	for _, want := range []string{`"twin"`, "--worker-id", "Config.Worker"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not name %s: %v", want, err)
		}
	}
	if taken.Registered.IsZero() || taken.Worker != "twin" {
		t.Errorf("the error: %+v", taken)
	}
	if held := len(first.c.Held()); held != n {
		t.Errorf("the first twin holds %d of %d partitions after the second tried", held, n)
	}
}

// A worker restarted under its ID after a crash finds its earlier
// incarnation's registration, which nobody renews any more: it waits for
// it to expire and takes its place, with no error.
func TestRestartAfterCrashWaitsForOwnRegistration(t *testing.T) {
	t.Parallel()
	const n = 2
	js, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	// The crashed incarnation's registration: written once, never renewed.
	ttl := 2 * time.Second
	rec := fmt.Sprintf(`{"holder":"phoenix","token":"crashed","ttl_ms":%d,"acquired":%q,"holds":""}`, ttl.Milliseconds(), time.Now().UTC().Format(time.RFC3339Nano))
	if _, err := js.Publish(ctx, "$KV."+b.Name()+".member.phoenix", []byte(rec), jetstream.WithMsgTTL(ttl)); err != nil {
		t.Fatal(err)
	}
	m := startMemberTTL(t, b, "phoenix", n, ttl)
	waitFor(t, 30*time.Second, "the restarted worker registers and holds the partitions", func() bool { return len(m.c.Held()) == n })
	select {
	case err := <-m.done:
		t.Fatalf("the restarted worker's Run returned: %v", err)
	default:
	}
}
