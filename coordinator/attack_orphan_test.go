package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// A member that holds partitions its list does not show yet (a list
// written late, under load, or a view of it that is behind) has them taken
// over as unlisted by the member the assignment gives them to; the taker's
// epoch fences it, and it must learn so at once rather than hold the
// partition in its own eyes, and in its list, until its next progress
// commit is refused: once the taker is gone, nobody would take an idle
// partition its list still claims. Member a here lists nothing, and keeps
// every partition it is asked to give up (its drain hangs until its lease
// ends), so member b takes its share from a as unlisted records.
func TestUnlistedTakeOverEndsTheHoldersLease(t *testing.T) {
	t.Parallel()
	const n = 8
	ttl := 2 * time.Second
	_, b := startBucket(t)
	ctx := ctxFor(t, 90*time.Second)
	hang := make(chan struct{})
	ma := startMemberHooked(t, b, "a", n, ttl, func(c *coordinator.Config) {
		c.ShutdownTimeout = 5 * time.Minute
		c.OnRevoke = func(ctx context.Context, _ *coordinator.Lease) {
			select {
			case <-ctx.Done():
			case <-hang:
			}
		}
	}, func(c *coordinator.Coordinator) {
		c.SetListHook(func([]leasehold.Partition) []leasehold.Partition { return nil })
	})
	t.Cleanup(func() { close(hang) }) // runs before a's stop
	waitUntil(t, ctx, "a holds every partition", func() (bool, string) {
		held := ma.c.Held()
		return len(held) == n, fmt.Sprintf("a holds %d", len(held))
	})
	before := map[leasehold.Partition]*coordinator.Lease{}
	for _, l := range ma.c.Held() {
		before[l.Partition()] = l
	}

	mb := startMemberTTL(t, b, "b", n, ttl)
	var taken []*coordinator.Lease
	waitUntil(t, ctx, "b takes a partition over from a", func() (bool, string) {
		taken = taken[:0]
		for _, l := range mb.c.Held() {
			if old := before[l.Partition()]; old != nil && l.Epoch() > old.Epoch() {
				taken = append(taken, l)
			}
		}
		return len(taken) > 0, fmt.Sprintf("b holds %d", len(mb.c.Held()))
	})
	// The take-over is a write a's session did not make: a learns of it
	// within a request or two, not at a commit that may never come.
	learn := ctxFor(t, 10*ttl)
	for _, l := range taken {
		old := before[l.Partition()]
		select {
		case <-old.Done():
		case <-learn.Done():
			t.Fatalf("partition %d: b holds it at epoch %d, and a's lease at epoch %d has not ended %v later", l.Partition(), l.Epoch(), old.Epoch(), 10*ttl)
		}
		if err := old.Err(); err == nil {
			t.Errorf("partition %d: a's lease at epoch %d ended without an error", l.Partition(), old.Epoch())
		}
	}
	waitUntil(t, learn, "a no longer counts the leases taken from it", func() (bool, string) {
		for _, l := range ma.c.Held() {
			for _, tl := range taken {
				if l == before[tl.Partition()] {
					return false, fmt.Sprintf("a holds partition %d at epoch %d", l.Partition(), l.Epoch())
				}
			}
		}
		return true, ""
	})
}

// The list a worker's view shows of another member can be behind the one
// the leader has (a watch that lags under load): an acquisition that its
// view lets overwrite a live session's record as unlisted overwrites it
// only if the holder's registration, read through the leader, does not
// list the partition either.
func TestUnlistedTakeOverChecksTheListThroughTheLeader(t *testing.T) {
	t.Parallel()
	const n = 8
	_, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	cfg := func(name string) coordinator.Config {
		return coordinator.Config{Worker: name, TTL: 5 * time.Second, Partitions: n}
	}
	ca, err := coordinator.New(b, cfg("a"))
	if err != nil {
		t.Fatal(err)
	}
	sa, err := ca.RegisterListingSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sa.KeepRenewing()
	t.Cleanup(func() { sa.Release(context.Background()) })
	la, err := ca.AcquireInSession(ctx, 3, sa)
	if err != nil {
		t.Fatal(err)
	}
	if err := sa.Advertise(ctx, []leasehold.Partition{3}); err != nil {
		t.Fatal(err)
	}
	cb, err := coordinator.New(b, cfg("b"))
	if err != nil {
		t.Fatal(err)
	}
	sb, err := cb.RegisterListingSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sb.KeepRenewing()
	t.Cleanup(func() { sb.Release(context.Background()) })

	// b's view says a does not list partition 3; the leader says it does.
	l, err := cb.AcquireUnlisted(ctx, 3, sb, uint64(la.Epoch()))
	if err == nil {
		t.Fatalf("b overwrote a's record of partition 3 at epoch %d, which a's registration lists, and holds it at epoch %d", la.Epoch(), l.Epoch())
	}
	if !errors.Is(err, coordinator.ErrHeld) {
		t.Fatalf("b's acquisition of a listed partition: %v; want ErrHeld", err)
	}
	if err := la.Err(); err != nil {
		t.Fatalf("a's lease ended: %v", err)
	}

	// Once the leader's list leaves it out too, the record is b's to take.
	if err := sa.Advertise(ctx, nil); err != nil {
		t.Fatal(err)
	}
	l, err = cb.AcquireUnlisted(ctx, 3, sb, uint64(la.Epoch()))
	if err != nil {
		t.Fatalf("b's acquisition of a record a does not list: %v", err)
	}
	if l.Epoch() <= la.Epoch() {
		t.Fatalf("b holds partition 3 at epoch %d, not above a's %d", l.Epoch(), la.Epoch())
	}
}
