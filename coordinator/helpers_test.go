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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/testing/natstest"
)

// The tests wait on TTLs, expiries and elections far more than they
// compute, each on its own server: run more of them at once than the two
// a two-core machine gets by default.
func TestMain(m *testing.M) {
	testpar.Raise(4)
	testleak.VerifyTestMain(m)
}

// verify asks b whether it issued epoch e of id to acquisition a.
func verify(ctx context.Context, b *coordinator.Bucket, id leasehold.FenceID, e leasehold.Epoch, a string) error {
	return b.VerifyAcquisition(ctx, id, e, a)
}

// forgeRecordAcquisition rewrites the fence record under key, as any
// credential that may write the fence bucket can, so that its current
// acquisition and the newest it remembers are acq. It returns the record
// as it was, for the caller to put back.
func forgeRecordAcquisition(t *testing.T, ctx context.Context, b *coordinator.Bucket, key, acq string) []byte {
	t.Helper()
	orig, err := b.FenceRecords().Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var rec map[string]any
	if err := json.Unmarshal(orig.Value(), &rec); err != nil {
		t.Fatal(err)
	}
	acqs, ok := rec["acquisitions"].([]any)
	if !ok || len(acqs) == 0 {
		t.Fatalf("the record under %s remembers no acquisition: %s", key, orig.Value())
	}
	rec["acquisition"] = acq
	acqs[len(acqs)-1] = acq
	forged, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.FenceRecords().Put(ctx, key, forged); err != nil {
		t.Fatal(err)
	}
	return orig.Value()
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func provision(t *testing.T, js jetstream.JetStream, replicas int) *coordinator.Bucket {
	t.Helper()
	b, err := coordinator.Provision(ctxFor(t, 20*time.Second), js, coordinator.BucketConfig{Replicas: replicas, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// startBucket starts a server and provisions a lease bucket of one
// replica on it.
func startBucket(t *testing.T) (jetstream.JetStream, *coordinator.Bucket) {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	return js, provision(t, js, 1)
}

// jobStream creates the job stream of scope with n partitions, as
// worker.ProvisionJobs records them, holding jobs messages.
func jobStream(t *testing.T, js jetstream.JetStream, scope string, n, jobs int) {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     scope + "-jobs",
		Subjects: []string{scope + ".jobs.>"},
		Metadata: map[string]string{"leasehold.kind": "jobs", "leasehold.prefix": scope, "leasehold.partitions": fmt.Sprint(n)},
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range jobs {
		if _, err := js.Publish(ctx, fmt.Sprintf("%s.jobs.%d", scope, i%n), []byte("job")); err != nil {
			t.Fatal(err)
		}
	}
}

// provisionWithJobs provisions a lease bucket of replicas on js and its
// job stream of n partitions holding jobs messages.
func provisionWithJobs(t *testing.T, js jetstream.JetStream, replicas, n, jobs int) *coordinator.Bucket {
	t.Helper()
	b := provision(t, js, replicas)
	jobStream(t, js, b.Scope(), n, jobs)
	return b
}

// startBucketWithJobs is startBucket with the bucket's job stream of n
// partitions holding jobs messages.
func startBucketWithJobs(t *testing.T, n, jobs int) (jetstream.JetStream, *coordinator.Bucket) {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	return js, provisionWithJobs(t, js, 1, n, jobs)
}

func newCoord(t *testing.T, b *coordinator.Bucket, worker string, ttl time.Duration) *coordinator.Coordinator {
	t.Helper()
	c, err := coordinator.New(b, coordinator.Config{Worker: worker, TTL: ttl, Partitions: 64})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// acquireEventually retries until the partition is free, as a successor
// does after a lease expires.
func acquireEventually(t *testing.T, c *coordinator.Coordinator, p leasehold.Partition, within time.Duration, opts ...coordinator.AcquireOption) *coordinator.Lease {
	t.Helper()
	ctx := ctxFor(t, within)
	for {
		l, err := c.Acquire(ctx, p, opts...)
		if err == nil {
			return l
		}
		if !errors.Is(err, coordinator.ErrHeld) {
			t.Fatalf("acquire partition %d: %v", p, err)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("partition %d still held after %v: %v", p, within, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// heavy lets one test at a time run a three-node cluster: three servers
// replicating every write, under the race detector. Beside another, or
// six, a two-core machine starves leases of their renewals for longer
// than the 1–2 s TTLs the tests use, and leases lapse that the test needs
// held. busy does the same for the tests on one server that keep a core
// busy (thousands of leases or partitions). Other tests run beside them.
var heavy, busy = make(chan struct{}, 1), make(chan struct{}, 1)

// oneOf waits for slot; the slot is given back when the test (or subtest)
// ends, after everything it started has stopped.
func oneOf(t *testing.T, slot chan struct{}) {
	t.Helper()
	slot <- struct{}{}
	t.Cleanup(func() { <-slot })
}

// startCluster starts a three-node cluster for the test in the heavy slot.
func startCluster(t *testing.T, opts ...natstest.Option) *natstest.Cluster {
	t.Helper()
	oneOf(t, heavy)
	return natstest.StartCluster(t, opts...)
}

// onEachTopology runs f in a subtest on one server ("single") and in one on
// a three-node cluster ("cluster"), with the replicas a lease bucket takes
// there.
func onEachTopology(t *testing.T, f func(t *testing.T, js jetstream.JetStream, replicas int)) {
	t.Helper()
	t.Run("single", func(t *testing.T) { f(t, natstest.Start(t).JetStream(t), 1) })
	t.Run("cluster", func(t *testing.T) { f(t, startCluster(t).JetStream(t), 3) })
}

type member struct {
	c        *coordinator.Coordinator
	cancel   context.CancelFunc
	done     chan error
	acquired atomic.Int64
	revoked  atomic.Int64
	lapsed   atomic.Int64 // leases lost to their local deadline
}

func startMember(t *testing.T, b *coordinator.Bucket, name string, n int) *member {
	t.Helper()
	return startMemberTTL(t, b, name, n, 2*time.Second)
}

// startMemberTTL starts a member with lease TTL ttl. A test that is about
// the assignment, not about expiry, uses a TTL long enough that no lease
// lapses on a loaded machine: a lapse moves partitions the assignment
// would not have moved.
func startMemberTTL(t *testing.T, b *coordinator.Bucket, name string, n int, ttl time.Duration) *member {
	t.Helper()
	return startMemberWith(t, b, name, n, ttl, nil)
}

// startMemberWith starts a member as startMemberTTL does, with its
// configuration changed by edit (when not nil).
func startMemberWith(t *testing.T, b *coordinator.Bucket, name string, n int, ttl time.Duration, edit func(*coordinator.Config)) *member {
	t.Helper()
	return startMemberHooked(t, b, name, n, ttl, edit, nil)
}

// startMemberHooked is startMemberWith that has hook, when not nil, set up
// the coordinator (its test hooks) before it runs.
func startMemberHooked(t *testing.T, b *coordinator.Bucket, name string, n int, ttl time.Duration, edit func(*coordinator.Config), hook func(*coordinator.Coordinator)) *member {
	t.Helper()
	m := &member{done: make(chan error, 1)}
	cfg := coordinator.Config{
		Worker:     name,
		Partitions: n,
		TTL:        ttl,
		OnAcquire:  func(*coordinator.Lease) { m.acquired.Add(1) },
		OnRevoke:   func(context.Context, *coordinator.Lease) { m.revoked.Add(1) },
		Observer:   m,
	}
	if edit != nil {
		edit(&cfg)
	}
	c, err := coordinator.New(b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if hook != nil {
		hook(c)
	}
	m.run(t, c)
	return m
}

// run runs c as m's coordinator until m.stop or the end of the test.
func (m *member) run(t *testing.T, c *coordinator.Coordinator) {
	m.c = c
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go func() { m.done <- c.Run(ctx) }()
	t.Cleanup(func() { m.stop(t) })
}

// runGroup runs c's group until the test ends, then stops it and fails the
// test if Run returned an error.
func runGroup(t *testing.T, ctx context.Context, c *coordinator.Coordinator) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// LeaseEvent counts the leases that lapsed.
func (m *member) LeaseEvent(_ context.Context, e coordinator.Event) {
	if e.Kind == coordinator.EventLost && e.Reason == coordinator.LostDeadline {
		m.lapsed.Add(1)
	}
}

func (m *member) stop(t *testing.T) {
	if m.cancel == nil {
		return
	}
	m.cancel()
	m.cancel = nil
	select {
	case err := <-m.done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Error("Run did not return after its context ended")
	}
}

// ownership returns the owner of every partition, as the members see their
// own holdings, and whether it is balanced: every partition held exactly
// once and the counts within one of each other.
func ownership(ms map[string]*member, n int) ([]string, bool) {
	owners := make([]string, n)
	lo, hi := n, 0
	for name, m := range ms {
		held := m.c.Held()
		lo, hi = min(lo, len(held)), max(hi, len(held))
		for _, l := range held {
			if owners[l.Partition()] != "" {
				return nil, false
			}
			owners[l.Partition()] = name
		}
	}
	for _, o := range owners {
		if o == "" {
			return nil, false
		}
	}
	return owners, hi-lo <= 1
}

func waitBalanced(t *testing.T, ms map[string]*member, n int, within time.Duration) []string {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		if owners, ok := ownership(ms, n); ok {
			// Hold still: a balanced moment in passing is not convergence.
			time.Sleep(600 * time.Millisecond)
			if again, ok := ownership(ms, n); ok && fmt.Sprint(again) == fmt.Sprint(owners) {
				return owners
			}
		}
		if time.Now().After(deadline) {
			var counts []string
			for name, m := range ms {
				counts = append(counts, fmt.Sprintf("%s:%d", name, len(m.c.Held())))
			}
			t.Fatalf("not balanced after %v: %v", within, counts)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// lapses counts the leases the members lost to their local deadline: the
// server did not answer renewals in time (a loaded machine can starve a
// cluster of a leader for seconds), and the partitions moved for that.
func lapses(ms map[string]*member) int64 {
	var n int64
	for _, m := range ms {
		n += m.lapsed.Load()
	}
	return n
}

func revocations(ms map[string]*member) int64 {
	var n int64
	for _, m := range ms {
		n += m.revoked.Load()
	}
	return n
}

// checkHandoffs: every acquisition of a phase is a move, but for one each
// transient revocation explains — a member that saw the group change
// later than the others (a loaded machine delays watch updates past the
// rebalance delay) and handed off a partition that then came back.
func checkHandoffs(t *testing.T, phase string, moved int, handoffs, revoked int64) {
	t.Helper()
	transient := revoked - int64(moved)
	if handoffs == int64(moved) {
		return
	}
	if handoffs > int64(moved) && handoffs-int64(moved) <= transient {
		t.Logf("%s: %d hand-offs beyond the %d moves, after %d transient revocations while the views settled", phase, handoffs-int64(moved), moved, transient)
		return
	}
	t.Errorf("%s took %d acquisitions for %d moves (%d revocations)", phase, handoffs, moved, revoked)
}

func acquisitions(ms map[string]*member) int64 {
	var n int64
	for _, m := range ms {
		n += m.acquired.Load()
	}
	return n
}

func diff(a, b []string) int {
	n := 0
	for p := range a {
		if a[p] != b[p] {
			n++
		}
	}
	return n
}

// waitUntil polls cond until it holds or ctx ends.
func waitUntil(t *testing.T, ctx context.Context, what string, cond func() (bool, string)) {
	t.Helper()
	for {
		ok, state := cond()
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: not reached (%s)", what, state)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func heldPartitions(m *member) []int32 {
	var out []int32
	for _, l := range m.c.Held() {
		out = append(out, int32(l.Partition()))
	}
	return out
}

func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %v", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// openOverOwnConnection opens b again over a connection of its own to s,
// which the test may close to cut that client off.
func openOverOwnConnection(t *testing.T, s *natstest.Server, b *coordinator.Bucket) (*nats.Conn, *coordinator.Bucket) {
	t.Helper()
	nc := s.Connect(t)
	js, _ := jetstream.New(nc)
	return nc, mustOpen(t, js, b.Name())
}

// reconnectingJS connects to url for as long as the test runs, reconnecting
// without end every 50 ms while it cannot reach the server.
func reconnectingJS(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

func mustOpen(t *testing.T, js jetstream.JetStream, name string) *coordinator.Bucket {
	t.Helper()
	b, err := coordinator.OpenBucket(ctxFor(t, 20*time.Second), js, name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// waitQuiet waits until no member acquires or revokes anything for quiet,
// and fails if that does not happen within within.
func waitQuiet(t *testing.T, ms map[string]*member, quiet, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	last := acquisitions(ms) + revocations(ms)
	since := time.Now()
	for time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		if now := acquisitions(ms) + revocations(ms); now != last {
			last, since = now, time.Now()
			continue
		}
		if time.Since(since) >= quiet {
			return
		}
	}
	var state []string
	for name, m := range ms {
		state = append(state, fmt.Sprintf("%s holds %v (acquired %d, revoked %d)", name, heldPartitions(m), m.acquired.Load(), m.revoked.Load()))
	}
	t.Fatalf("the members never stopped moving partitions within %v: %v", within, state)
}

// watchDoubles samples the members' holdings until the test ends and
// reports, through the returned function, a partition that two members
// held at once for longer than within: a hand-off seen between two
// samples is a moment, two holders for a lease's length is a defect.
func watchDoubles(t *testing.T, ms func() map[string]*member, within time.Duration) func() string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var found atomicString
	go func() {
		defer close(done)
		since := map[int]time.Time{}
		for ctx.Err() == nil {
			holders := map[int][]string{}
			for name, m := range ms() {
				for _, p := range heldPartitions(m) {
					holders[int(p)] = append(holders[int(p)], name)
				}
			}
			for p, hs := range holders {
				if len(hs) < 2 {
					delete(since, p)
					continue
				}
				if _, ok := since[p]; !ok {
					since[p] = time.Now()
				} else if time.Since(since[p]) > within {
					found.set(fmt.Sprintf("partition %d held by %v for more than %v", p, hs, within))
				}
			}
			for p := range since {
				if len(holders[p]) < 2 {
					delete(since, p)
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return found.get
}

type atomicString struct {
	mu sync.Mutex
	s  string
}

func (a *atomicString) set(s string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.s == "" {
		a.s = s
	}
}

func (a *atomicString) get() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.s
}

// startSessionMember starts a member as startMemberTTL does: its
// partitions live as long as its member session, the default.
func startSessionMember(t *testing.T, b *coordinator.Bucket, name string, n int, ttl time.Duration) *member {
	t.Helper()
	return startMemberWith(t, b, name, n, ttl, nil)
}

// startRenewingMember starts a member that renews each partition's lease
// on its own, as before member sessions.
func startRenewingMember(t *testing.T, b *coordinator.Bucket, name string, n int, ttl time.Duration) *member {
	t.Helper()
	return startMemberWith(t, b, name, n, ttl, func(c *coordinator.Config) { c.RenewPartitions = true })
}
