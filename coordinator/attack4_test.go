package coordinator_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// noticeSubject is the subject of a notice to worker carrying value: the
// key of the partition value names (0 when it names none).
func noticeSubject(b *coordinator.Bucket, worker string, value []byte) string {
	var n struct{ Partition uint32 }
	_ = json.Unmarshal(value, &n)
	return fmt.Sprintf("$KV.%s.notice.%s.%d", b.Name(), worker, n.Partition)
}

// forgeNotice publishes value as notice.<worker>.<partition>, as anyone who can write
// to the lease bucket can.
func forgeNotice(t *testing.T, ctx context.Context, js jetstream.JetStream, b *coordinator.Bucket, worker string, value []byte) {
	t.Helper()
	if _, err := js.Publish(ctx, noticeSubject(b, worker, value), value, jetstream.WithMsgTTL(5*time.Second)); err != nil {
		t.Fatal(err)
	}
}

// forgeNotices publishes each of values as notice.<worker>.<partition>, in order, as
// forgeNotice does, without waiting for each acknowledgement before the
// next: a window of them is in flight at once, and it returns when the
// server has stored them all.
func forgeNotices(t *testing.T, ctx context.Context, js jetstream.JetStream, b *coordinator.Bucket, worker string, values [][]byte) {
	t.Helper()
	const window = 256
	for len(values) > 0 {
		n := min(window, len(values))
		acks := make([]jetstream.PubAckFuture, 0, n)
		for _, v := range values[:n] {
			f, err := js.PublishAsync(noticeSubject(b, worker, v), v, jetstream.WithMsgTTL(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			acks = append(acks, f)
		}
		for _, f := range acks {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				t.Fatal(err)
			case <-ctx.Done():
				t.Fatalf("forged notices not stored: %v", ctx.Err())
			}
		}
		values = values[n:]
	}
}

// Notices nobody's Fence wrote, to a worker holding partitions under its
// session: garbage, partitions it does not hold or the group does not
// have, the epochs it holds at with their records intact, and a flood of
// those, end none of its leases, and a real Fence after them still ends
// the one it removed: the worker reads every notice and is not stuck.
func TestAttack4ForgedNoticesEndNoLease(t *testing.T) {
	t.Parallel()
	oneOf(t, busy) // 8,000 notices, each read by the holder
	const n = 8
	srv := natstest.Start(t)
	b := provision(t, srv.JetStream(t), 1)
	js := srv.JetStream(t) // the forger's own connection
	ctx := ctxFor(t, 2*time.Minute)
	ms := map[string]*member{
		"a": startMemberTTL(t, b, "a", n, 5*time.Second),
		"b": startMemberTTL(t, b, "b", n, 5*time.Second),
	}
	waitBalanced(t, ms, n, 30*time.Second)
	a := ms["a"]
	held := a.c.Held()
	if len(held) < 2 {
		t.Fatalf("a holds %d partitions", len(held))
	}
	notHeld := map[leasehold.Partition]bool{}
	for p := range n {
		notHeld[leasehold.Partition(p)] = true
	}
	for _, l := range held {
		delete(notHeld, l.Partition())
	}
	var forged [][]byte
	for _, raw := range []string{
		``, `garbage`, `{}`, `null`, `[]`, `{"partition":-1,"epoch":1}`,
		`{"partition":4294967295,"epoch":1}`, `{"partition":99999999999999999999,"epoch":1}`,
		`{"partition":1e300,"epoch":1}`, `{"partition":8,"epoch":1}`,
		`{"partition":0,"epoch":18446744073709551615}`,
	} {
		forged = append(forged, []byte(raw))
	}
	for p := range notHeld {
		v, _ := json.Marshal(map[string]any{"partition": p, "epoch": 1})
		forged = append(forged, v)
	}
	for _, l := range held {
		// The epoch it holds at, off by one, and exactly: the record is intact.
		for _, e := range []leasehold.Epoch{l.Epoch() - 1, l.Epoch() + 1, l.Epoch()} {
			v, _ := json.Marshal(map[string]any{"partition": l.Partition(), "epoch": e})
			forged = append(forged, v)
		}
	}
	// A flood of the notices that make the holder ask the leader.
	for range 2000 {
		for _, l := range held {
			v, _ := json.Marshal(map[string]any{"partition": l.Partition(), "epoch": l.Epoch()})
			forged = append(forged, v)
		}
	}
	forgeNotices(t, ctx, js, b, "a", forged)

	// A real Fence of one of them: the notice it leaves comes after every
	// forged one, so its effect shows the worker has read them all.
	victim, rest := held[0], held[1:]
	op, err := coordinator.New(b, coordinator.Config{Worker: "operator", TTL: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	res, err := op.Fence(ctx, victim.Partition())
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-victim.Done():
	case <-ctx.Done():
		t.Fatalf("the lease on partition %d outlived a Fence that followed %d forged notices", victim.Partition(), len(forged))
	}
	// The holder ends a lease on a notice only after its own leader read,
	// which runs in the background: wait for the ones the flood started
	// by waiting for the group to hold the fenced partition again.
	waitUntil(t, ctx, "the fenced partition held again", func() (bool, string) {
		for _, m := range ms {
			for _, l := range m.c.Held() {
				if l.Partition() == victim.Partition() && l.Epoch() > res.Epoch {
					return true, ""
				}
			}
		}
		return false, ""
	})
	for _, l := range rest {
		select {
		case <-l.Done():
			t.Errorf("forged notices ended a's lease on partition %d at epoch %d: %v", l.Partition(), l.Epoch(), l.Err())
		default:
		}
	}
	if lapses(ms) != 0 {
		t.Errorf("%d leases lapsed under the flood of notices", lapses(ms))
	}
}

// forgeForeignLease writes partition.<p> as a record leasehold cannot read
// (a newer format, say) carrying a per-message TTL, and renews it, each
// write on the revision of the one before, every ttl/4 until the test
// ends, as a live holder would. It reports the first renewal refused: the
// record was overwritten under a live holder.
func forgeForeignLease(t *testing.T, js jetstream.JetStream, b *coordinator.Bucket, p int, ttl time.Duration) (renewals func() int, overwritten func() string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	subject := fmt.Sprintf("$KV.%s.partition.%d", b.Name(), p)
	value := []byte(`{"format":99,"holder":"next-version"}`)
	ack, err := js.Publish(ctx, subject, value, jetstream.WithMsgTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		count int
		lost  string
	)
	go func() {
		defer close(done)
		rev := ack.Sequence
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(ttl / 4):
			}
			a, err := js.Publish(ctx, subject, value, jetstream.WithMsgTTL(ttl), jetstream.WithExpectLastSequencePerSubject(rev))
			mu.Lock()
			if err != nil {
				if ctx.Err() == nil && lost == "" {
					lost = fmt.Sprintf("renewal on revision %d refused: %v", rev, err)
				}
				mu.Unlock()
				return
			}
			rev = a.Sequence
			count++
			mu.Unlock()
		}
	}()
	return func() int { mu.Lock(); defer mu.Unlock(); return count },
		func() string { mu.Lock(); defer mu.Unlock(); return lost }
}

// A record leasehold cannot read that its writer keeps renewing is a live
// lease of some other writer: the group dates it by the watch's revisions,
// and a record that changes every quarter TTL is never older than a lease
// can be. Nobody overwrites it while it is renewed, the rest of the group
// settles, and once it stops being renewed the server expires it and the
// partition is taken.
func TestAttack4RenewedForeignRecordIsNeverTakenOver(t *testing.T) {
	t.Parallel()
	const n, p = 4, 2
	// The writer renews every quarter TTL, and its record lives a TTL on
	// the server: a 2 s TTL let a writer starved for 2 s on a loaded
	// machine lose its record to the server's expiry, and the test took
	// the partition's legitimate taking for an overwrite.
	const ttl = 5 * time.Second
	js, b := startBucket(t)
	ctx := ctxFor(t, 2*time.Minute)
	renewals, overwritten := forgeForeignLease(t, js, b, p, ttl)
	logs := map[string]*logRecorder{"a": {}, "b": {}}
	ms := map[string]*member{}
	for name, rec := range logs {
		ms[name] = startMemberWith(t, b, name, n, ttl, func(c *coordinator.Config) { c.Logger = slog.New(rec) })
	}
	// Longer than a foreign record may stand unchanged (TTL +
	// max(TTL/2, 1s) = 7.5s) by more than half again: 16 renewals, 20 s.
	waitUntil(t, ctx, "16 renewals of the foreign record", func() (bool, string) {
		if s := overwritten(); s != "" {
			t.Fatalf("a live foreign record was overwritten: %s", s)
		}
		return renewals() >= 16, fmt.Sprint(renewals())
	})
	for name, m := range ms {
		for _, l := range m.c.Held() {
			if l.Partition() == p {
				t.Fatalf("%s holds partition %d at epoch %d while its foreign record is renewed", name, p, l.Epoch())
			}
		}
	}
	if s := overwritten(); s != "" {
		t.Fatalf("a live foreign record was overwritten: %s", s)
	}
	// Each renewal is a new revision of a record leasehold did not
	// write; a member logs about it once a minute, not once a revision.
	key := fmt.Sprintf("partition.%d", p)
	for name, rec := range logs {
		if got := rec.about(key, ""); got > 1 {
			t.Errorf("%s logged %d warnings about %s in %d renewals: want one a minute", name, got, key, renewals())
		}
	}
}

// A cold start on an R3 bucket whose stream leader steps down while the
// members register and acquire, and again as the last one joins, ends with every partition held once, and
// never two holders for a lease's length.
func TestAttack4LeaderChangeDuringColdStart(t *testing.T) {
	t.Parallel()
	const n = 32
	const ttl = 5 * time.Second
	cl := startCluster(t)
	js := cl.JetStream(t)
	b := provision(t, js, 3)
	ctx := ctxFor(t, 3*time.Minute)
	stream := "KV_" + b.Name()
	var mu sync.Mutex
	ms := map[string]*member{}
	snapshot := func() map[string]*member { mu.Lock(); defer mu.Unlock(); return maps.Clone(ms) }
	doubles := watchDoubles(t, snapshot, ttl)
	nc := cl.Connect(t)
	for i, name := range []string{"w0", "w1", "w2"} {
		m := startMemberTTL(t, b, name, n, ttl)
		mu.Lock()
		ms[name] = m
		mu.Unlock()
		if i != 1 {
			// Once acquisitions run: step the bucket's leader down.
			floor := acquisitions(snapshot())
			waitUntil(t, ctx, "acquisitions under way", func() (bool, string) { return acquisitions(snapshot()) > floor, "" })
			before := cl.StreamLeader(t, stream, 30*time.Second)
			if _, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, ctx, "a new stream leader", func() (bool, string) {
				return cl.StreamLeader(t, stream, 30*time.Second) != before, ""
			})
		}
	}
	waitBalanced(t, snapshot(), n, 90*time.Second)
	if s := doubles(); s != "" {
		t.Fatal(s)
	}
}

// A registration that looks live and lists a partition another member
// holds gets its share of the assignment, which nobody else takes: the
// listed partition is given up by its holder, and the share stays free for
// as long as the registration stays. The status says so, naming the
// registration, and says nothing of the working members.
func TestAttack4ListOfPartitionsNotHeldShowsInStatus(t *testing.T) {
	t.Parallel()
	const n = 6
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, time.Minute)
	// Markers that outlast a lease, as the default minute does: the
	// release of the listed partition is dated by its marker.
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ms := map[string]*member{
		"a": startMemberTTL(t, b, "a", n, 2*time.Second),
		"b": startMemberTTL(t, b, "b", n, 2*time.Second),
	}
	owners := waitBalanced(t, ms, n, 30*time.Second)
	other := slices.Index(owners, "a")
	forgeMember(t, js, b, "0forger", 2*time.Second, holdsOf(other))
	waitUntil(t, ctx, "a finding on the forged registration's list", func() (bool, string) {
		st, err := b.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, f := range st.Findings {
			switch {
			case f.Kind != coordinator.FindingListDisagrees:
			case f.Key == "member.0forger":
				found = true
			default:
				t.Fatalf("a working member's list is reported: %v", f)
			}
		}
		return found, fmt.Sprint(st.Findings)
	})
}

// A registration that lists every partition, each held by a real member,
// costs the group its own share and no more: the members keep the rest,
// whatever the forger claims.
func TestAttack4ListOfEveryPartitionCostsOnlyItsShare(t *testing.T) {
	t.Parallel()
	const n = 6 // over 3 members: 2 each
	ms := settleUnderForgedList(t)
	if a, b := len(ms["a"].c.Held()), len(ms["b"].c.Held()); a+b != n-2 {
		t.Fatalf("a holds %d and b %d: a forged list of every partition should cost only its own share of 2", a, b)
	}
}

// Working members' lists are never reported, through a join and a leave
// that move partitions, with markers that outlast a lease.
func TestAttack4WorkingListsAreNotReported(t *testing.T) {
	t.Parallel()
	const n = 12
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 2*time.Minute)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	check := func(phase string) {
		st, err := b.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range st.Findings {
			t.Errorf("%s: %v", phase, f)
		}
	}
	ms := map[string]*member{
		"a": startMemberTTL(t, b, "a", n, 2*time.Second),
		"b": startMemberTTL(t, b, "b", n, 2*time.Second),
	}
	waitBalanced(t, ms, n, 30*time.Second)
	check("two members")
	ms["c"] = startMemberTTL(t, b, "c", n, 2*time.Second)
	waitBalanced(t, ms, n, 30*time.Second)
	check("c joined")
	ms["a"].stop(t)
	delete(ms, "a")
	waitBalanced(t, ms, n, 30*time.Second)
	// Past the point a stuck list of a's would be reported.
	deadline := time.Now().Add(4 * time.Second)
	waitUntil(t, ctx, "a lease's length after the hand-off", func() (bool, string) {
		check("a left")
		return time.Now().After(deadline), ""
	})
}

// The lease bucket re-created under running members, by a machine whose
// clock is behind, starts above the highest epoch its fence records hold,
// which can be below revisions the old bucket issued after it (renewals,
// lists, notices). The members' watch dated those; a record leasehold
// cannot read that someone writes, and keeps renewing, in the new bucket
// is not older for it: nobody overwrites it while it is renewed.
func TestAttack4RecreatedBucketDoesNotAgeNewRecords(t *testing.T) {
	const n, p = 4, 1
	const ttl = 2 * time.Second
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 2*time.Minute)
	cfg := coordinator.BucketConfig{Bucket: "orders-leases", MarkerTTL: time.Second}
	b, err := coordinator.Provision(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	jobStream(t, js, "orders", n, 8)
	// A fence record for every partition, then many more writes: the old
	// bucket's revisions climb well above its highest epoch.
	c := newCoord(t, b, "setup", ttl)
	for q := range leasehold.Partition(n) {
		l, err := c.Acquire(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Commit(ctx, 1); err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for range 3000 {
		if _, err := js.Publish(ctx, "$KV."+b.Name()+".notice.nobody", []byte("x"), jetstream.WithMsgTTL(time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	ms := map[string]*member{
		"a": startMemberTTL(t, b, "a", n, ttl),
		"b": startMemberTTL(t, b, "b", n, ttl),
	}
	waitBalanced(t, ms, n, 30*time.Second)
	// Let the revisions the members saw grow older than a lease can be.
	seen := time.Now()
	waitUntil(t, ctx, "the members' revisions older than a lease", func() (bool, string) {
		return time.Since(seen) > 2*ttl, ""
	})

	if err := js.DeleteStream(ctx, "KV_"+b.Name()); err != nil {
		t.Fatal(err)
	}
	behind := time.Now().Add(-time.Hour)
	restore := coordinator.SetWallClock(func() time.Time { return behind })
	nb, err := coordinator.Provision(ctx, js, cfg)
	restore()
	if err != nil {
		t.Fatal(err)
	}
	renewals, overwritten := forgeForeignLease(t, js, nb, p, ttl)
	// Twice as long as a foreign record may stand unchanged (TTL +
	// max(TTL/2, 1s) = 3s): a record the members dated by the old
	// bucket's revisions would be taken at once. The test cannot run
	// beside others (it sets the package's clock), so it waits no longer.
	waitUntil(t, ctx, "12 renewals of the foreign record in the new bucket", func() (bool, string) {
		if s := overwritten(); s != "" {
			t.Fatalf("a live foreign record in the re-created bucket was overwritten: %s", s)
		}
		return renewals() >= 12, fmt.Sprint(renewals())
	})
	waitUntil(t, ctx, "every other partition held again", func() (bool, string) {
		held := map[leasehold.Partition]int{}
		for _, m := range ms {
			for _, l := range m.c.Held() {
				held[l.Partition()]++
			}
		}
		return len(held) == n-1 && held[p] == 0, fmt.Sprint(held)
	})
	if s := overwritten(); s != "" {
		t.Fatalf("a live foreign record in the re-created bucket was overwritten: %s", s)
	}
}

// A flood of notices naming a lease at the epoch it holds (anyone who can
// write to the bucket can send them) costs its holder one leader read at a
// time: the notices that come during a read get one more read between
// them, and a notice after that its own.
func TestAttack4NoticeFloodReadsOneAtATime(t *testing.T) {
	t.Parallel()
	const n, flood = 4, 500
	js, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	a := startMemberTTL(t, b, "a", n, 5*time.Second)
	waitBalanced(t, map[string]*member{"a": a}, n, 30*time.Second)
	l := a.c.Held()[0]

	// Each notice is the same to the holder; the tag tells the test
	// which one it saw. The watch may skip notices a later one replaced,
	// never the last.
	forge := func(tag string) {
		v, _ := json.Marshal(map[string]any{"partition": l.Partition(), "epoch": l.Epoch(), "tag": tag})
		forgeNotice(t, ctx, js, b, "a", v)
	}
	var mu sync.Mutex
	seen := map[string]bool{}
	notices, reads, idle := 0, 0, 0
	first := make(chan struct{})
	release := sync.OnceFunc(func() { close(first) })
	t.Cleanup(release)
	a.c.SetNoticeHook(func(event string, data []byte) {
		mu.Lock()
		switch event {
		case "notice":
			var n struct{ Tag string }
			_ = json.Unmarshal(data, &n)
			seen[n.Tag] = true
			notices++
		case "idle":
			idle++
		case "read":
			reads++
			if reads == 1 {
				mu.Unlock()
				<-first // the first read takes as long as the test needs
				return
			}
		}
		mu.Unlock()
	})
	state := func() (string, int, int) {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("%d notices seen, %d reads, %d idle", notices, reads, idle), reads, idle
	}
	waitFor := func(what string, done func(reads, idle int) bool) {
		t.Helper()
		waitUntil(t, ctx, what, func() (bool, string) {
			s, r, i := state()
			return done(r, i), s
		})
	}
	sawTag := func(tag string) func(int, int) bool {
		return func(int, int) bool {
			mu.Lock()
			defer mu.Unlock()
			return seen[tag]
		}
	}

	for i := range flood {
		forge(fmt.Sprint(i))
	}
	forge("flood-end")
	waitFor("the flood's last notice, during the first read", sawTag("flood-end"))
	if s, r, _ := state(); r != 1 {
		t.Fatalf("%s: leader reads began while the first was in flight", s)
	}
	release()
	waitFor("one more read for the notices during the first, and then none", func(r, i int) bool { return i == 1 })
	if s, r, _ := state(); r != 2 {
		t.Fatalf("%s: want 2 reads for the flood", s)
	}
	forge("after")
	waitFor("a read for the notice after the flood", func(r, i int) bool { return i == 2 })
	select {
	case <-l.Done():
		t.Errorf("the notices ended the lease on partition %d: %v", l.Partition(), l.Err())
	default:
	}
	a.stop(t) // waits for the reads in flight
	if s, r, _ := state(); r != 3 {
		t.Errorf("%s: want 3 reads", s)
	}
}
