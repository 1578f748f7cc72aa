package streamsink_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A runner holds the log's next messages (fetched ahead) beyond the batch
// it is saving. When it stops, or dies, holding them, the next runner on
// the consumer still applies every effect once, none twice, none stale:
// a runner that stops hands them back, and one that dies leaves them to
// be read from the log. The kills: a stop between batches, and a crash
// after the position of a batch was saved and before its acks, while the
// batches after it are held.
func TestStopAndCrashHoldingFetchedMessages(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"stop", "crash"} {
		t.Run(mode, func(t *testing.T) { testHoldingFetched(t, mode) })
	}
}

func testHoldingFetched(t *testing.T, mode string) {
	srv := natstest.Start(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	prefix := "held" + mode
	// An ack wait longer than the test: what the first runner held comes
	// back only if it is handed back or read from the log.
	cfg := streamsink.Config{Prefix: prefix, Provision: true, Batch: 4, AckWait: 10 * time.Minute, Logger: quiet()}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	want, stale, last := history(t, ctx, js, prefix)

	first, err := streamsink.New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	var batches atomic.Int32
	reached, release := make(chan struct{}), make(chan struct{})
	crash := errors.New("killed")
	first.SetHook(func(p string) error {
		if p != "saved" || batches.Add(1) != 3 {
			return nil
		}
		if mode == "crash" {
			return crash
		}
		close(reached)
		<-release
		return nil
	})
	rr := run(t, first)
	if mode == "stop" {
		select {
		case <-reached:
		case <-ctx.Done():
			t.Fatal("the first runner did not reach its third batch")
		}
		rr.cancel()
		close(release)
		if err := rr.stop(); err != nil {
			t.Fatalf("Run = %v, want nil after a stop", err)
		}
	} else if err := rr.waitDone(ctx); !errors.Is(err, crash) {
		t.Fatalf("Run = %v, want the kill", err)
	}
	if first.Position() >= last {
		t.Fatalf("the first runner reached %d of %d: the kill was not mid-log", first.Position(), last)
	}

	next := start(t, srv.JetStream(t), cfg)
	if err := next.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	checkApplied(t, ctx, js, prefix+"-fenced", want, stale)
	if mode == "stop" {
		// Everything the first runner held was handed back and acked by
		// the next one, long before the ack wait.
		cons, err := js.Consumer(ctx, prefix+"-effects", prefix+"-sink")
		if err != nil {
			t.Fatal(err)
		}
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			info, err := cons.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if info.NumAckPending == 0 && info.NumPending == 0 {
				break
			}
			select {
			case <-ctx.Done():
				t.Fatalf("after the stop, %d messages stay unacked: the first runner's fetched messages were not handed back", info.NumAckPending)
			case <-tick.C:
			}
		}
	}
}

// A runner whose log is quiet hands a message over as it arrives, with
// no fetch to wait for after it.
func TestQuietLogHandledAtOnce(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	cfg := streamsink.Config{Prefix: "quiet", Provision: true, FetchWait: time.Hour, Logger: quiet()}
	r := start(t, js, cfg)
	for i := range 5 {
		h := nats.Header{}
		leasehold.Stamp{Scope: "quiet", Partition: 0, Epoch: 3, Acquisition: "a3", Key: fmt.Sprintf("k%d", i)}.SetHeader(h)
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "quiet.out.x", Header: h, Data: []byte("x")})
		if err != nil {
			t.Fatal(err)
		}
		// With an hour's fetch wait, a runner that waited for its fetch
		// to end would never get here.
		if err := r.WaitPosition(ctx, ack.Sequence); err != nil {
			t.Fatal(err)
		}
	}
}

// A pull fails while the runner is busy with a batch: the fetcher hands
// the error on and waits for it to be taken. Once Run has taken it (and
// counted and retried it), the fetcher pulls again: the next message is
// handled, not left behind a fetcher waiting for a batch nobody holds.
func TestFetchFailureWhileABatchIsHandled(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	cfg := streamsink.Config{Prefix: "fetchfail", Provision: true, Batch: 4, FetchWait: 20 * time.Millisecond, MaxBackoff: 10 * time.Millisecond, Logger: quiet()}
	r, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Run is held in the delivery of the message the test marks; a pull
	// that starts while it is held fails, and Run goes on once the
	// fetcher waits with that pull's error for Run to take it.
	var hold, holding, failed atomic.Bool
	waiting := make(chan struct{})
	r.SetHook(func(point string) error {
		switch point {
		case "delivered":
			if hold.CompareAndSwap(true, false) {
				holding.Store(true)
				select {
				case <-waiting:
				case <-ctx.Done():
				}
			}
		case "fetch":
			if holding.Load() && failed.CompareAndSwap(false, true) {
				return errors.New("the pull failed")
			}
		case "wait":
			if failed.Load() && holding.CompareAndSwap(true, false) {
				close(waiting)
			}
		}
		return nil
	})
	run(t, r)
	publish := func(key string) uint64 {
		return publishStamped(t, ctx, js, "fetchfail.out.x", "fetchfail", 3, key, false)
	}
	if err := r.WaitPosition(ctx, publish("before")); err != nil {
		t.Fatal(err)
	}
	hold.Store(true)
	if err := r.WaitPosition(ctx, publish("held")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-waiting:
	default:
		t.Fatal("the runner was not held while a pull failed")
	}
	after := publish("after")
	if err := r.WaitPosition(ctx, after); err != nil {
		t.Fatalf("the message after a failed pull: %v (at %d of %d)", err, r.Position(), after)
	}
}

// A fetcher held up (here by the test, at the start of a pull) leaves
// Run nothing to take, which Run cannot tell from a quiet log:
// Ready reports it, and reports the runner ready again once it pulls.
func TestReadyReportsAFetcherHeldUp(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	cfg := streamsink.Config{Prefix: "heldup", Provision: true, FetchWait: 20 * time.Millisecond, StallAfter: 200 * time.Millisecond, Logger: quiet()}
	r, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var stuck atomic.Bool
	release := make(chan struct{})
	done := sync.OnceFunc(func() { close(release) })
	r.SetHook(func(point string) error {
		if point == "fetch" && stuck.Load() {
			<-release
		}
		return nil
	})
	run(t, r)
	t.Cleanup(done) // before run's: a runner stops once its fetcher does
	if err := awaitReady(t, ctx, r, "ready", func(err error) bool { return err == nil }); err != nil {
		t.Fatal(err)
	}
	stuck.Store(true)
	err = awaitReady(t, ctx, r, "a fetcher held up reported", func(err error) bool { return err != nil })
	if err == nil || !strings.Contains(err.Error(), "fetcher is held up") {
		t.Fatalf("Ready = %v, want the fetcher held up", err)
	}
	stuck.Store(false)
	done()
	first := publishStamped(t, ctx, js, "heldup.out.x", "heldup", 3, "k", false)
	if err := r.WaitPosition(ctx, first); err != nil {
		t.Fatal(err)
	}
	if err := awaitReady(t, ctx, r, "ready again", func(err error) bool { return err == nil }); err != nil {
		t.Fatal(err)
	}
}
