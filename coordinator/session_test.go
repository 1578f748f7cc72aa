package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// sessionRecord is the part of a partition record the tests look at.
type sessionRecord struct {
	Holder  string `json:"holder"`
	Session uint64 `json:"session"`
}

// A group of session members writes its partition records once, at
// acquisition: while the members renew their registrations, no partition
// key is written, every record names its holder's session and carries no
// per-message TTL, and each partition's epoch is its record's revision.
func TestSessionsWriteOnlyMemberKeysWhileIdle(t *testing.T) {
	t.Parallel()
	const n = 32
	s := natstest.Start(t)
	js := s.JetStream(t)
	b := provision(t, js, 1)
	ms := map[string]*member{}
	for _, id := range []string{"a", "b"} {
		ms[id] = startSessionMember(t, b, id, n, 2*time.Second)
	}
	waitBalanced(t, ms, n, 30*time.Second)
	ctx := ctxFor(t, 60*time.Second)
	kv, err := js.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	sessions := map[string]uint64{}
	for id := range ms {
		e, err := kv.Get(ctx, "member."+id)
		if err != nil {
			t.Fatal(err)
		}
		var r struct {
			Epoch uint64 `json:"epoch"`
		}
		if err := json.Unmarshal(e.Value(), &r); err != nil {
			t.Fatal(err)
		}
		sessions[id] = r.Epoch
		if r.Epoch == 0 {
			sessions[id] = e.Revision()
		}
	}
	stream, err := js.Stream(ctx, "KV_"+b.Name())
	if err != nil {
		t.Fatal(err)
	}
	epochs := map[leasehold.Partition]leasehold.Epoch{}
	for id, m := range ms {
		for _, l := range m.c.Held() {
			epochs[l.Partition()] = l.Epoch()
			msg, err := stream.GetLastMsgForSubject(ctx, "$KV."+b.Name()+".partition."+l.Partition().String())
			if err != nil {
				t.Fatal(err)
			}
			var r sessionRecord
			if err := json.Unmarshal(msg.Data, &r); err != nil {
				t.Fatal(err)
			}
			if r.Holder != id || r.Session != sessions[id] {
				t.Errorf("partition %d: record names %s session %d, want %s session %d", l.Partition(), r.Holder, r.Session, id, sessions[id])
			}
			if msg.Sequence != uint64(l.Epoch()) {
				t.Errorf("partition %d: record at revision %d, epoch %d", l.Partition(), msg.Sequence, l.Epoch())
			}
			if ttl := msg.Header.Get(jetstream.MsgTTLHeader); ttl != "" {
				t.Errorf("partition %d: record carries a per-message TTL %q", l.Partition(), ttl)
			}
		}
	}

	parts, err := kv.Watch(ctx, "partition.>", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer parts.Stop()
	members, err := kv.Watch(ctx, "member.>", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer members.Stop()
	renewals := map[string]int{}
	for renewals["member.a"] < 4 || renewals["member.b"] < 4 {
		select {
		case e := <-members.Updates():
			if e != nil {
				if e.Operation() != jetstream.KeyValuePut {
					t.Fatalf("%s: %v while idle", e.Key(), e.Operation())
				}
				renewals[e.Key()]++
			}
		case e := <-parts.Updates():
			if e != nil {
				t.Fatalf("%s written while idle (revision %d, %v)", e.Key(), e.Revision(), e.Operation())
			}
		case <-ctx.Done():
			t.Fatalf("renewals seen: %v", renewals)
		}
	}
	if lapses(ms) != 0 {
		t.Skipf("%d leases lapsed on a loaded machine; the idle check is void", lapses(ms))
	}
	for _, m := range ms {
		for _, l := range m.c.Held() {
			if epochs[l.Partition()] != l.Epoch() {
				t.Errorf("partition %d: epoch %d became %d while idle", l.Partition(), epochs[l.Partition()], l.Epoch())
			}
		}
	}
	t.Logf("member renewals %v, no partition write", renewals)
}

// A holder whose registration expires while it still believes it holds (a
// paused process whose local deadline has not fired yet): while the
// registration lives no taker gets the partition; once it has expired,
// takers racing on the cluster get it exactly once, at a higher epoch; the
// old holder's commit and renewal are refused.
func TestSessionExpiredHolderIsTakenOnce(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	b := provision(t, cl.JetStream(t), 3)
	ctx := ctxFor(t, 180*time.Second)
	const p, takers, rounds = leasehold.Partition(3), 4, 4
	kv, err := cl.JetStream(t).KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	type taker struct {
		c    *coordinator.Coordinator
		sess *coordinator.Lease
	}
	ts := make([]taker, takers)
	for i := range ts {
		bi, err := coordinator.OpenBucket(ctx, cl.JetStream(t), b.Name())
		if err != nil {
			t.Fatal(err)
		}
		c := newCoord(t, bi, fmt.Sprintf("taker-%d", i), 2*time.Second)
		s, err := c.RegisterSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		s.KeepRenewing()
		t.Cleanup(func() { _ = s.Release(context.Background()) })
		ts[i] = taker{c, s}
	}
	var last leasehold.Epoch
	for round := range rounds {
		z := newCoord(t, b, fmt.Sprintf("zombie-%d", round), 2*time.Second)
		zs, err := z.RegisterSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		zl, err := z.AcquireInSession(ctx, p, zs)
		if err != nil {
			t.Fatal(err)
		}
		if zl.Epoch() <= last {
			t.Fatalf("round %d: epoch %d not above %d", round, zl.Epoch(), last)
		}
		zs.Freeze() // the zombie never notices its deadline

		// While the registration lives, nobody takes the partition.
		for _, tk := range ts {
			if _, err := tk.c.AcquireInSession(ctx, p, tk.sess); !errors.Is(err, coordinator.ErrHeld) {
				if zs.Err() == nil && err == nil {
					// Allowed only if the registration expired meanwhile.
					if _, gerr := kv.Get(ctx, "member."+z.Worker()); gerr == nil {
						t.Fatalf("round %d: %s took the partition from a live session", round, tk.c.Worker())
					}
				}
				if err != nil {
					t.Fatalf("round %d: %v", round, err)
				}
				t.Skip("the registration expired before the takers could try: machine too slow for this check")
			}
		}

		// Wait for the server to expire the registration.
		w, err := kv.Watch(ctx, "member."+z.Worker())
		if err != nil {
			t.Fatal(err)
		}
		for e := range w.Updates() {
			if e != nil && e.Operation() != jetstream.KeyValuePut {
				break
			}
		}
		_ = w.Stop()
		if zl.Err() != nil {
			t.Fatalf("round %d: the frozen zombie noticed: %v", round, zl.Err())
		}

		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			wins []*coordinator.Lease
			held atomic.Int32
		)
		for _, tk := range ts {
			wg.Add(1)
			go func() {
				defer wg.Done()
				l, err := tk.c.AcquireInSession(ctx, p, tk.sess)
				switch {
				case err == nil:
					mu.Lock()
					wins = append(wins, l)
					mu.Unlock()
				case errors.Is(err, coordinator.ErrHeld):
					held.Add(1)
				default:
					t.Errorf("round %d: %s: %v", round, tk.c.Worker(), err)
				}
			}()
		}
		wg.Wait()
		if len(wins) != 1 {
			t.Fatalf("round %d: %d takers won (%d refused)", round, len(wins), held.Load())
		}
		win := wins[0]
		if win.Epoch() <= zl.Epoch() {
			t.Fatalf("round %d: successor epoch %d not above the zombie's %d", round, win.Epoch(), zl.Epoch())
		}
		if err := zl.Commit(ctx, 10); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Fatalf("round %d: the zombie's commit: %v, want lease lost", round, err)
		}
		if err := zs.Renew(ctx); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Fatalf("round %d: the zombie's renewal: %v, want lease lost", round, err)
		}
		if !errors.Is(zl.Err(), leasehold.ErrLeaseLost) {
			t.Fatalf("round %d: the zombie's partition lease after its registration was refused: %v", round, zl.Err())
		}
		last = win.Epoch()
		if err := win.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// A member that stops renewing (a frozen connection: its requests hang,
// nothing closes) loses every partition at its local deadline, the others
// take them over at higher epochs, across a kill of the lease bucket's
// stream leader, and when it thaws it holds nothing it had: its late
// renewal is refused and it joins again under a new session.
func TestSessionFrozenMemberFailsOverAcrossLeaderKill(t *testing.T) {
	t.Parallel()
	const n = 12
	cl := startCluster(t, natstest.Listen())
	b := provision(t, cl.JetStream(t), 3)
	ctx := ctxFor(t, 120*time.Second)
	leaderNode := cl.StreamLeader(t, "KV_"+b.Name(), 20*time.Second)
	other := (leaderNode + 1) % 3
	px := natstest.NewProxy(t, cl.Node(other).URL())
	bC, err := coordinator.OpenBucket(ctx, reconnectingJS(t, px.URL()), b.Name())
	if err != nil {
		t.Fatal(err)
	}
	ttl := 2 * time.Second
	ms := map[string]*member{
		"a": startSessionMember(t, b, "a", n, ttl),
		"b": startSessionMember(t, mustOpen(t, cl.JetStream(t), b.Name()), "b", n, ttl),
		"c": startSessionMember(t, bC, "c", n, ttl),
	}
	waitBalanced(t, ms, n, 60*time.Second)
	frozen := ms["c"].c.Held()
	if len(frozen) == 0 {
		t.Fatal("c holds nothing")
	}
	cl.Kill(leaderNode)
	px.Freeze()
	cut := time.Now()
	for _, l := range frozen {
		select {
		case <-l.Done():
		case <-ctx.Done():
			t.Fatalf("c's lease on %d outlived its deadline", l.Partition())
		}
		if !errors.Is(l.Err(), leasehold.ErrLeaseLost) {
			t.Fatalf("c's lease on %d ended with %v", l.Partition(), l.Err())
		}
	}
	mc := ms["c"]
	delete(ms, "c")
	waitBalanced(t, ms, n, 60*time.Second)
	t.Logf("fail-over of %d partitions across a leader kill completed %v after the freeze (TTL %v)", len(frozen), time.Since(cut).Round(time.Millisecond), ttl)
	for _, old := range frozen {
		for _, m := range ms {
			for _, l := range m.c.Held() {
				if l.Partition() == old.Partition() && l.Epoch() <= old.Epoch() {
					t.Errorf("partition %d taken over at epoch %d, not above %d", l.Partition(), l.Epoch(), old.Epoch())
				}
			}
		}
	}
	cl.Restart(t, leaderNode)
	px.Thaw()
	// c's late renewal is refused; it registers again under a new session
	// and the group balances over all three.
	ms["c"] = mc
	waitBalanced(t, ms, n, 60*time.Second)
	for _, l := range mc.c.Held() {
		for _, old := range frozen {
			if l.Partition() == old.Partition() && l.Epoch() <= old.Epoch() {
				t.Errorf("c holds partition %d again at epoch %d, not above its old %d", l.Partition(), l.Epoch(), old.Epoch())
			}
		}
	}
}

// A fleet that mixes the two kinds of lease: a partition lease that renews
// itself is never taken by a session member while its holder renews, and
// is taken once released; members renewing every partition and members
// living by sessions balance together; and when a session member is cut
// off, a member renewing every partition takes over what its session held
// once the registration expires, at higher epochs.
func TestMixedFleet(t *testing.T) {
	t.Parallel()
	const n, p = 8, leasehold.Partition(2)
	s := natstest.Start(t)
	b := provision(t, s.JetStream(t), 1)
	ctx := ctxFor(t, 90*time.Second)

	// The test is about a holder that renews: a 1 s TTL, the server's
	// least, let its lease lapse between two renewals on a loaded machine.
	own := newCoord(t, b, "self-renewing", 3*time.Second)
	ol, err := own.Acquire(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	ncS := s.Connect(t)
	jsS, err := jetstream.New(ncS)
	if err != nil {
		t.Fatal(err)
	}
	sm := startSessionMember(t, mustOpen(t, jsS, b.Name()), "sess", n, 2*time.Second)
	waitFor(t, 30*time.Second, "the session member holds every other partition", func() bool { return len(sm.c.Held()) == n-1 })
	kv, err := s.JetStream(t).KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	w, err := kv.Watch(ctx, "partition."+p.String(), jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	for renewals := 0; renewals < 4; {
		select {
		case e := <-w.Updates():
			if e == nil {
				continue
			}
			var r sessionRecord
			if e.Operation() != jetstream.KeyValuePut || json.Unmarshal(e.Value(), &r) != nil || r.Holder != "self-renewing" {
				t.Fatalf("partition %d changed hands while its holder renewed: %v %s", p, e.Operation(), e.Value())
			}
			renewals++
		case <-ctx.Done():
			t.Fatal("no renewals seen")
		}
	}
	_ = w.Stop()
	if ol.Err() != nil {
		t.Fatalf("the self-renewing lease ended: %v", ol.Err())
	}
	if err := ol.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the session member takes the released partition", func() bool { return len(sm.c.Held()) == n })
	for _, l := range sm.c.Held() {
		if l.Partition() == p && l.Epoch() <= ol.Epoch() {
			t.Fatalf("partition %d taken at epoch %d, not above %d", p, l.Epoch(), ol.Epoch())
		}
	}

	// A member renewing every partition joins; then the session member is
	// cut off: it can no longer renew, release or deregister.
	ms := map[string]*member{"sess": sm}
	ms["renewing"] = startRenewingMember(t, b, "renewing", n, 2*time.Second)
	waitBalanced(t, ms, n, 60*time.Second)
	sessHeld := sm.c.Held()
	ncS.Close()
	for _, l := range sessHeld {
		select {
		case <-l.Done():
		case <-ctx.Done():
			t.Fatalf("the cut-off member's lease on %d outlived its deadline", l.Partition())
		}
	}
	delete(ms, "sess")
	waitBalanced(t, ms, n, 60*time.Second)
	for _, old := range sessHeld {
		for _, l := range ms["renewing"].c.Held() {
			if l.Partition() == old.Partition() && l.Epoch() <= old.Epoch() {
				t.Errorf("partition %d taken over at epoch %d, not above %d", l.Partition(), l.Epoch(), old.Epoch())
			}
		}
	}
}
