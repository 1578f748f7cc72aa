package coordinator_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// listed returns the partitions member id's registration lists, and
// whether it lists any (a registration that does not advertise returns
// ok false).
func listed(t *testing.T, ctx context.Context, kv jetstream.KeyValue, id string, n int) (ps []int32, ok bool) {
	t.Helper()
	e, err := kv.Get(ctx, "member."+id)
	if err != nil {
		t.Fatalf("read member.%s: %v", id, err)
	}
	var rec struct {
		Holds *string `json:"holds"`
	}
	if err := json.Unmarshal(e.Value(), &rec); err != nil {
		t.Fatalf("member.%s: %v", id, err)
	}
	if rec.Holds == nil {
		return nil, false
	}
	ps, err = coordinator.DecodeHolds(*rec.Holds, n)
	if err != nil {
		t.Fatalf("member.%s lists %q: %v", id, *rec.Holds, err)
	}
	return ps, true
}

// partitionWatchers counts the consumers on the lease bucket's stream that
// read the partition records.
func partitionWatchers(t *testing.T, ctx context.Context, js jetstream.JetStream, b *coordinator.Bucket) int {
	t.Helper()
	s, err := js.Stream(ctx, "KV_"+b.Name())
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for info := range s.ListConsumers(ctx).Info() {
		filters := append([]string{info.Config.FilterSubject}, info.Config.FilterSubjects...)
		for _, f := range filters {
			if strings.Contains(f, ".partition.") {
				n++
			}
		}
	}
	return n
}

// Members list what they hold in their own registrations, and watch the
// member records only: no consumer reads the partition records.
func TestMembersListWhatTheyHold(t *testing.T) {
	t.Parallel()
	const n = 48
	js, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	kv, err := js.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	ms := map[string]*member{}
	for _, id := range []string{"a", "b", "c"} {
		ms[id] = startMemberTTL(t, b, id, n, 5*time.Second)
	}
	waitBalanced(t, ms, n, 30*time.Second)
	waitUntil(t, ctx, "every registration lists what its member holds", func() (bool, string) {
		for id, m := range ms {
			got, ok := listed(t, ctx, kv, id, n)
			if want := heldPartitions(m); !ok || !slices.Equal(got, want) {
				return false, fmt.Sprintf("member.%s lists %v (advertising %v), holds %v", id, got, ok, want)
			}
		}
		return true, ""
	})
	if w := partitionWatchers(t, ctx, js, b); w != 0 {
		t.Fatalf("%d consumers read the partition records; members that all list their holdings need none", w)
	}

	// A hand-off: the leaver's partitions are listed by the others.
	ms["c"].stop(t)
	delete(ms, "c")
	waitBalanced(t, ms, n, 30*time.Second)
	waitUntil(t, ctx, "the lists follow the hand-off", func() (bool, string) {
		var all []int32
		for id, m := range ms {
			got, _ := listed(t, ctx, kv, id, n)
			if want := heldPartitions(m); !slices.Equal(got, want) {
				return false, fmt.Sprintf("member.%s lists %v, holds %v", id, got, want)
			}
			all = append(all, got...)
		}
		slices.Sort(all)
		return len(slices.Compact(all)) == n, fmt.Sprintf("%d partitions listed", len(all))
	})
}

// A member that does not list its holdings (an earlier version, or one
// that renews its partitions itself) makes every member watch the
// partition records again, and the group still shares every partition
// out once; when it leaves, the partition watches end.
func TestAMemberWithoutAListBringsBackThePartitionWatch(t *testing.T) {
	t.Parallel()
	const n = 48
	js, b := startBucket(t)
	ctx := ctxFor(t, 90*time.Second)
	ms := map[string]*member{
		"a": startMemberTTL(t, b, "a", n, 5*time.Second),
		"b": startMemberTTL(t, b, "b", n, 5*time.Second),
	}
	waitBalanced(t, ms, n, 30*time.Second)
	if w := partitionWatchers(t, ctx, js, b); w != 0 {
		t.Fatalf("%d consumers read the partition records before any member needs them", w)
	}

	old := &member{done: make(chan error, 1)}
	c, err := coordinator.New(b, coordinator.Config{Worker: "old", Partitions: n, TTL: 5 * time.Second, RenewPartitions: true})
	if err != nil {
		t.Fatal(err)
	}
	old.run(t, c)
	ms["old"] = old
	waitBalanced(t, ms, n, 60*time.Second)
	waitUntil(t, ctx, "every member watches the partition records", func() (bool, string) {
		w := partitionWatchers(t, ctx, js, b)
		return w >= 3, fmt.Sprintf("%d partition watchers", w)
	})

	old.stop(t)
	delete(ms, "old")
	waitBalanced(t, ms, n, 60*time.Second)
	waitUntil(t, ctx, "the partition watches end with the member that needed them", func() (bool, string) {
		w := partitionWatchers(t, ctx, js, b)
		return w == 0, fmt.Sprintf("%d partition watchers", w)
	})
}

// A partition record written under a live session whose member does not
// hold it, and so does not list it, is taken over by the member the
// assignment gives it to, once it has stayed unlisted for longer than a
// list can lag: its holder does not see the partition records, and nobody
// else may take a live session's record. Member a here is a registration
// kept alive that took every partition and lists none of them.
func TestUnlistedRecordOfALiveSessionIsTakenOver(t *testing.T) {
	t.Parallel()
	const n = 16
	_, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	ca, err := coordinator.New(b, coordinator.Config{Worker: "a", TTL: 2 * time.Second, Partitions: n})
	if err != nil {
		t.Fatal(err)
	}
	session, err := ca.RegisterListingSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	session.KeepRenewing()
	t.Cleanup(func() { session.Release(context.Background()) })
	epochs := map[int]uint64{}
	for p := range n {
		l, err := ca.AcquireInSession(ctx, leasehold.Partition(p), session)
		if err != nil {
			t.Fatal(err)
		}
		epochs[p] = uint64(l.Epoch())
	}
	mb := startMemberTTL(t, b, "b", n, 2*time.Second)
	waitUntil(t, ctx, "b holds its share", func() (bool, string) {
		held := mb.c.Held()
		return len(held) == n/2, fmt.Sprintf("b holds %d", len(held))
	})
	for _, l := range mb.c.Held() {
		if uint64(l.Epoch()) <= epochs[int(l.Partition())] {
			t.Errorf("partition %d: epoch %d, not above the unlisted record's %d", l.Partition(), l.Epoch(), epochs[int(l.Partition())])
		}
	}
}

// An operator's Fence of a partition a worker holds, in a group that
// watches the member records only, ends that worker's lease at once (the
// Fence leaves it a notice), and the group takes the partition again with
// a higher epoch though no job ever makes the holder commit.
func TestFenceOfAListedPartitionIsTakenBack(t *testing.T) {
	t.Parallel()
	const n = 8
	js, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	ms := map[string]*member{
		"a": startMemberTTL(t, b, "a", n, 5*time.Second),
		"b": startMemberTTL(t, b, "b", n, 5*time.Second),
	}
	owners := waitBalanced(t, ms, n, 30*time.Second)
	if w := partitionWatchers(t, ctx, js, b); w != 0 {
		t.Fatalf("%d partition watchers: the members should watch the member records only", w)
	}
	var before *coordinator.Lease
	for _, l := range ms[owners[3]].c.Held() {
		if l.Partition() == 3 {
			before = l
		}
	}
	op, err := coordinator.New(b, coordinator.Config{Worker: "operator", TTL: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	res, err := op.Fence(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	if res.Previous.Epoch != before.Epoch() {
		t.Fatalf("Fence removed epoch %d, the holder held %d", res.Previous.Epoch, before.Epoch())
	}
	select {
	case <-before.Done():
	case <-ctx.Done():
		t.Fatalf("the holder's lease on partition 3 outlived the Fence")
	}
	waitUntil(t, ctx, "partition 3 held again above the fenced epoch", func() (bool, string) {
		for _, m := range ms {
			for _, l := range m.c.Held() {
				if l.Partition() == 3 && l.Epoch() > res.Epoch {
					return true, ""
				}
			}
		}
		return false, fmt.Sprintf("fenced at %d", res.Epoch)
	})
}
