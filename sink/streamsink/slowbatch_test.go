package streamsink_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A handler that is slow (an API taking 200 ms an effect) over a batch
// that takes longer than StallAfter is not reported stalled: the runner
// advances while it delivers effects. Only a batch that delivers nothing
// for StallAfter is (TestHandlerThatStopsDeliveringIsAStall).
func TestSlowBatchIsNotAStall(t *testing.T) {
	t.Parallel()
	const (
		stallAfter = 2 * time.Second
		perEffect  = 200 * time.Millisecond
		effects    = 15 // 3 s in one batch, past stallAfter
	)
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, time.Minute)
	rn, err := streamsink.New(ctx, js, streamsink.Config{Prefix: "slowbatch", Provision: true, StallAfter: stallAfter, Logger: quiet(),
		Handler: func(ctx context.Context, _ sink.Effect) error {
			// The slow API's work; not a wait on the test.
			select {
			case <-time.After(perEffect):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	publishStamped(t, ctx, js, "slowbatch.out.0", "slowbatch", 1, "barrier", true)
	var last uint64
	for i := range effects {
		last = publishStamped(t, ctx, js, "slowbatch.out.0", "slowbatch", 1, fmt.Sprintf("k%d", i), false)
	}
	began := time.Now()
	r := run(t, rn)
	done := make(chan error, 1)
	go func() { done <- r.WaitPosition(ctx, last) }()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			if took := time.Since(began); took < stallAfter {
				t.Fatalf("the batch took %v, less than StallAfter %v: the test proves nothing", took, stallAfter)
			}
			return
		case <-tick.C:
			if err := r.Ready(ctx); err != nil && strings.Contains(err.Error(), "no progress") {
				t.Fatalf("a slow handler delivering an effect every %v was reported stalled after %v: %v", perEffect, time.Since(began).Round(time.Millisecond), err)
			}
		}
	}
}

// A handler that delivers an effect and then does not return is reported
// stalled once StallAfter has passed since that delivery: deliveries show
// progress only while they go on.
func TestHandlerThatStopsDeliveringIsAStall(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, time.Minute)
	release := make(chan struct{})
	defer close(release)
	calls := 0
	rn, err := streamsink.New(ctx, js, streamsink.Config{Prefix: "stopdeliver", Provision: true, StallAfter: time.Second, Logger: quiet(),
		Handler: func(ctx context.Context, _ sink.Effect) error {
			calls++ // the runner calls its Handler from one goroutine
			if calls == 2 {
				select {
				case <-release:
				case <-ctx.Done():
				}
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	publishStamped(t, ctx, js, "stopdeliver.out.0", "stopdeliver", 1, "barrier", true)
	for i := range 3 {
		publishStamped(t, ctx, js, "stopdeliver.out.0", "stopdeliver", 1, fmt.Sprintf("k%d", i), false)
	}
	r := run(t, rn)
	if err := awaitReady(t, ctx, r.Runner, "a stall", func(err error) bool { return err != nil && strings.Contains(err.Error(), "delivering nothing") }); err == nil {
		t.Fatal("a handler that does not return was never reported stalled")
	}
}
