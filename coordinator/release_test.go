package coordinator_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A lease Run handed out and its owner released (a worker gives a
// partition up when a handler hangs) leaves Run's holdings: Run takes the
// partition again, under a new epoch, instead of counting it as held.
func TestRunTakesAGivenUpPartitionAgain(t *testing.T) {
	b := provision(t, natstest.Start(t).JetStream(t), 1)
	leases := make(chan *coordinator.Lease, 4)
	c, err := coordinator.New(b, coordinator.Config{
		Worker: "a", Partitions: 1, TTL: 2 * time.Second,
		OnAcquire: func(l *coordinator.Lease) { leases <- l },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	next := func(what string) *coordinator.Lease {
		t.Helper()
		select {
		case l := <-leases:
			return l
		case <-time.After(time.Minute):
			t.Fatalf("gave up waiting for %s", what)
			return nil
		}
	}
	first := next("the first acquisition")
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	if err := first.Release(rctx); err != nil {
		t.Fatal(err)
	}
	second := next("Run to acquire the released partition again")
	if second.Epoch() <= first.Epoch() {
		t.Fatalf("epoch %d after %d", second.Epoch(), first.Epoch())
	}
	if held := c.Held(); len(held) != 1 || held[0] != second {
		t.Fatalf("Run holds %v", held)
	}
}
