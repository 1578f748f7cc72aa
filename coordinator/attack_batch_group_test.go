package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// logSignal closes a channel the first time a logger logs msg, at any
// level.
type logSignal struct {
	msg  string
	once sync.Once
	seen chan struct{}
}

func newLogSignal(msg string) *logSignal { return &logSignal{msg: msg, seen: make(chan struct{})} }

func (s *logSignal) Enabled(context.Context, slog.Level) bool { return true }
func (s *logSignal) Handle(_ context.Context, r slog.Record) error {
	if r.Message == s.msg {
		s.once.Do(func() { close(s.seen) })
	}
	return nil
}
func (s *logSignal) WithAttrs([]slog.Attr) slog.Handler { return s }
func (s *logSignal) WithGroup(string) slog.Handler      { return s }

// A batch whose commit reaches the server only after its member stopped
// waiting for the answer (the connection froze with the whole batch in
// it): the member goes one by one with the records the batch carried,
// finds its own tokens stored, and hands every partition out at the
// revision the batch stored it at, fenced, without a second record.
func TestAttackBatchLandsAfterItsAnswerWasGivenUp(t *testing.T) {
	const n = 50
	s := natstest.Start(t, natstest.Listen())
	js := s.JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	ctx := ctxFor(t, time.Minute)
	px := natstest.NewProxy(t, s.URL())
	jsP := reconnectingJS(t, px.URL())
	gaveUp := newLogSignal("acquisition batch not written; acquiring its partitions one by one")
	c, err := coordinator.New(mustOpen(t, jsP, b.Name()), coordinator.Config{Worker: "w", TTL: 10 * time.Second, Partitions: n, Logger: slog.New(gaveUp)})
	if err != nil {
		t.Fatal(err)
	}
	sess := renewedSession(t, c)
	stream, err := js.Stream(ctx, "KV_"+b.Name())
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := info.State.LastSeq

	px.Freeze()
	ps := partitionsUpTo(n)
	type result struct {
		leases []*coordinator.Lease
		errs   []error
	}
	res := make(chan result, 1)
	go func() {
		leases, errs := c.AcquireBatch(ctx, ps, sess)
		res <- result{leases, errs}
	}()
	select {
	case <-gaveUp.seen:
	case <-ctx.Done():
		t.Fatal("the member never gave up on the frozen batch")
	}
	px.Thaw()
	r := <-res
	if err := errors.Join(r.errs...); err != nil {
		t.Fatal(err)
	}
	if recs, _ := c.Batches(); recs != 0 {
		t.Errorf("%d batches counted as landed; its answer was never read", recs)
	}
	first := r.leases[0].Epoch()
	for i, l := range r.leases {
		v.checkLive(t, ctx, l, sess)
		// The batch's revisions, in its order: not a second write.
		if l.Epoch() != first+leasehold.Epoch(i) {
			t.Errorf("partition %d at epoch %d, not %d where the batch stored it", l.Partition(), l.Epoch(), first+leasehold.Epoch(i))
		}
	}
	if info, err = stream.Info(ctx); err != nil {
		t.Fatal(err)
	}
	if info.State.LastSeq-before < n {
		t.Errorf("the lease stream advanced by %d for %d partitions", info.State.LastSeq-before, n)
	}
	t.Logf("lease stream advanced by %d revisions for %d partitions", info.State.LastSeq-before, n)
}

func checkHolders(t *testing.T, ctx context.Context, v *leaderView, ms map[string]*member) {
	t.Helper()
	for name, m := range ms {
		for _, l := range m.c.Held() {
			p := l.Partition()
			r := v.record(t, ctx, p)
			if !r.value || r.Holder != name || r.Token != l.Info().Acquisition || (r.Session != 0 && r.rev != uint64(l.Epoch())) {
				t.Errorf("partition %d: %s holds it at epoch %d; the leader has value=%v at revision %d of %s (session %d)", p, name, l.Epoch(), r.value, r.rev, r.Holder, r.Session)
			}
			if f := v.fence(t, ctx, p); f.Epoch != uint64(l.Epoch()) || f.Acquisition != l.Info().Acquisition {
				t.Errorf("partition %d: fence record at epoch %d of %s, %s holds epoch %d of %s", p, f.Epoch, f.Acquisition, name, l.Epoch(), l.Info().Acquisition)
			}
		}
	}
}

// A fleet that mixes session members with a member whose leases renew
// themselves makes the session members watch the partition records and
// batch what the view shows free at the revisions it shows: stale hints
// while the renewing member joins in the middle of a cold start and leaves
// again, and while a session member leaves, still end with every partition
// held once and balanced, each record its holder's own, and no fence
// record's epoch down.
func TestAttackMixedFleetBatchesOnViewHints(t *testing.T) {
	const n = 256
	js, b := startBucket(t)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ttl := 5 * time.Second
	ms := map[string]*member{
		"a": startSessionMember(t, b, "a", n, ttl),
		"b": startSessionMember(t, b, "b", n, ttl),
		"c": startSessionMember(t, b, "c", n, ttl),
	}
	waitFor(t, 60*time.Second, "a quarter of the partitions acquired", func() bool { return acquisitions(ms) >= n/4 })
	ms["r"] = startRenewingMember(t, b, "r", n, ttl)
	waitBalanced(t, ms, n, 60*time.Second)
	ms["r"].stop(t)
	delete(ms, "r")
	ms["b"].stop(t)
	delete(ms, "b")
	ms["d"] = startSessionMember(t, b, "d", n, ttl)
	waitBalanced(t, ms, n, 60*time.Second)
	checkHolders(t, ctxFor(t, time.Minute), v, ms)
	if s := wentDown(); s != "" {
		t.Error(s)
	}
	var recs int64
	for _, m := range ms {
		r, _ := m.c.Batches()
		recs += r
	}
	t.Logf("%d acquisitions, %d batches of records landed", acquisitions(ms), recs)
}

// A server that takes batches of at most 16 messages, and one open batch
// per stream at a time, refuses a member's first batches of a cold start
// as too large: the member halves its batches until they land and takes
// what was refused one by one; members joining then take their shares
// while the first hands them off, and the group ends with every partition
// held once and balanced, each at its own record's revision and fenced.
func TestAttackGroupBatchesUnderTightServerLimits(t *testing.T) {
	const n = 600
	js := natstest.Start(t, natstest.Tweak(func(o *server.Options) {
		o.JetStreamLimits.MaxBatchSize = 16
		o.JetStreamLimits.MaxBatchInflightPerStream = 1
	})).JetStream(t)
	b := provision(t, js, 1)
	v := newLeaderView(js, b)
	wentDown := watchFenceEpochs(t, b)
	ms := map[string]*member{"a": startSessionMember(t, b, "a", n, 5*time.Second)}
	waitBalanced(t, ms, n, 60*time.Second)
	if recs, _ := ms["a"].c.Batches(); recs == 0 {
		t.Error("no batch landed: the member never shrank its batches to what the server takes")
	}
	for _, name := range []string{"b", "c"} {
		ms[name] = startSessionMember(t, b, name, n, 5*time.Second)
	}
	waitBalanced(t, ms, n, 60*time.Second)
	checkHolders(t, ctxFor(t, time.Minute), v, ms)
	if s := wentDown(); s != "" {
		t.Error(s)
	}
	var recs, fences int64
	for _, m := range ms {
		r, f := m.c.Batches()
		recs, fences = recs+r, fences+f
	}
	t.Logf("%d acquisitions; %d batches of records and %d of fences landed", acquisitions(ms), recs, fences)
}

// Members batching the partitions of a member whose registration stopped
// renewing: they start as its local deadline passes, before the server
// has expired the registration, and try again once a watch shows it
// expired. Each partition goes to exactly one of them, at an epoch above
// the old holder's, never before the old holder's local deadline had
// passed; the old holder's commits are refused.
func TestAttackBatchesTakeOverAnExpiringSession(t *testing.T) {
	const n = 48
	js, b := startBucket(t)
	v := newLeaderView(js, b)
	ctx := ctxFor(t, time.Minute)
	kv, err := js.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	old := newCoord(t, b, "old", time.Second)
	expired, err := kv.Watch(ctx, "member.old", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	osess, err := old.RegisterListingSession(ctx) // never renewed
	if err != nil {
		t.Fatal(err)
	}
	ps := partitionsUpTo(n)
	oldLeases, errs := old.AcquireBatch(ctx, ps, osess)
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	cs := []*contender{newContender(t, b, "x"), newContender(t, b, "y")}
	defer expired.Stop()
	<-osess.Done()
	deadline := osess.Deadline()
	race := func(round string) {
		var wg sync.WaitGroup
		for i, c := range cs {
			order := slices.Clone(ps)
			rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			wg.Go(func() {
				leases, errs := c.c.AcquireBatch(ctx, order, c.sess)
				for k, err := range errs {
					switch {
					case err == nil:
						c.leases[order[k]] = leases[k]
					case !errors.Is(err, coordinator.ErrHeld):
						t.Errorf("%s: member %d: partition %d: %v", round, i, order[k], err)
					}
				}
			})
		}
		wg.Wait()
	}
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for e := range expired.Updates() {
			if e != nil && e.Operation() != jetstream.KeyValuePut {
				return
			}
		}
	}()
	// Batches go out back to back from the local deadline on, across the
	// server's expiry, and once more after the watch has shown it.
	races := 0
	for done := false; !done; {
		select {
		case <-gone:
			done = true
		default:
		}
		race(fmt.Sprintf("race %d", races))
		races++
	}
	t.Logf("%d rounds of batches from the local deadline to past the expiry", races)
	for _, p := range ps {
		var winners []*contender
		for _, c := range cs {
			if c.leases[p] != nil {
				winners = append(winners, c)
			}
		}
		if len(winners) != 1 {
			t.Errorf("partition %d: %d winners", p, len(winners))
			continue
		}
		l, ol := winners[0].leases[p], oldLeases[p]
		v.checkLive(t, ctx, l, winners[0].sess)
		if l.Epoch() <= ol.Epoch() {
			t.Errorf("partition %d taken over at epoch %d, not above the old %d", p, l.Epoch(), ol.Epoch())
		}
		if m := lastThroughLeader(t, ctx, v.leases, "$KV."+b.Name()+".partition."+p.String()); !m.Time.After(deadline) {
			t.Errorf("partition %d taken over at %v, before the old holder's deadline %v", p, m.Time, deadline)
		}
		if err := ol.Commit(ctx, 1); !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Errorf("partition %d: the old holder's commit: %v, want ErrLeaseLost", p, err)
		}
	}
}
