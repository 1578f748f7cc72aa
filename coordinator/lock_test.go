package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
)

func TestLockNameEncoding(t *testing.T) {
	t.Parallel()
	var all strings.Builder
	for c := byte('!'); c <= '~'; c++ {
		all.WriteByte(c)
	}
	for _, name := range []string{"account:42", "report-generator", "a", "_", "__5F", all.String()[:94], strings.Repeat("é"[:1], 1)} {
		enc := coordinator.EncodeLockName(name)
		if leasehold.ValidateLockName(name) != nil {
			continue
		}
		for i := 0; i < len(enc); i++ {
			if c := enc[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				t.Fatalf("%q encodes to %q, which is not one KV key token", name, enc)
			}
		}
		if back, err := coordinator.DecodeLockName(enc); err != nil || back != name {
			t.Fatalf("%q -> %q -> %q, %v", name, enc, back, err)
		}
	}
	if got := coordinator.EncodeLockName("account:42"); got != "account_3A42" {
		t.Fatalf("account:42 encodes to %q", got)
	}
	for _, bad := range []string{"", "a_", "a_3", "a_3a", "a_41", "a.b", "a_20", "a_7F"} {
		if name, err := coordinator.DecodeLockName(bad); err == nil {
			t.Errorf("DecodeLockName(%q) = %q, want an error", bad, name)
		}
	}
}

// The lock's lifecycle through the public API: A takes it, B is refused
// and then waits, A hands it off, B holds it with a higher token, in the
// lock's own scope; A's stale lease can neither renew nor release.
func TestLockHandOff(t *testing.T) {
	t.Parallel()
	onEachTopology(t, func(t *testing.T, js jetstream.JetStream, replicas int) {
		b := provision(t, js, replicas)
		a, bw := newCoord(t, b, "a", 2*time.Second), newCoord(t, b, "b", 2*time.Second)
		ctx := ctxFor(t, 30*time.Second)

		la, err := a.TryLock(ctx, "account:42")
		if err != nil {
			t.Fatal(err)
		}
		info := la.Info()
		if info.Scope != leasehold.LockScope(b.Scope(), "account:42") || info.Partition != 0 || la.Name() != "account:42" || info.Acquisition == "" {
			t.Fatalf("lock lease %+v", info)
		}
		if got, err := b.IssuedEpoch(ctx, info.Fence()); err != nil || got != info.Epoch {
			t.Fatalf("IssuedEpoch of the lock = %d, %v; want %d", got, err, info.Epoch)
		}
		_, err = bw.TryLock(ctx, "account:42")
		var held *coordinator.HeldError
		if !errors.As(err, &held) || held.Lease.Holder != "a" || held.Lock != "account:42" || !strings.Contains(err.Error(), `lock "account:42"`) {
			t.Fatalf("TryLock of a held lock: %v", err)
		}
		if h, ok, err := bw.LockHolder(ctx, "account:42"); err != nil || !ok || h.Holder != "a" || h.Epoch != info.Epoch {
			t.Fatalf("LockHolder = %+v, %v, %v", h, ok, err)
		}
		got := lockInBackground(t, ctx, bw, "account:42")
		select {
		case r := <-got:
			t.Fatalf("B took the lock while A held it: %v, %v", r.l, r.err)
		case <-time.After(100 * time.Millisecond):
		}
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		var lb *coordinator.Lease
		select {
		case r := <-got:
			if r.err != nil {
				t.Fatalf("B's Lock: %v", r.err)
			}
			lb = r.l
		case <-ctx.Done():
			t.Fatal("B did not get the lock after A released it")
		}
		defer lb.Release(ctx)
		if lb.Epoch() <= la.Epoch() || lb.Info().Scope != info.Scope {
			t.Fatalf("B holds %v after A's %v", lb.Info(), info)
		}
		if err := la.Renew(ctx); !errors.Is(err, coordinator.ErrReleased) && !errors.Is(err, leasehold.ErrLeaseLost) {
			t.Fatalf("renew of a released lock: %v", err)
		}
		if err := lb.Commit(ctx, 1); err == nil {
			t.Fatal("Commit on a lock succeeded")
		}
	})
}

// I6 and the sinks: A's lease on the lock lapses (it stops renewing), its
// Context ends, B's blocked Lock takes the lock when the server expires
// it, B writes; A's late write through the same sink is refused as stale,
// and the resource holds B's value.
func TestLockZombieRefusedBySink(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	a, bw := newCoord(t, b, "a", time.Second), newCoord(t, b, "b", time.Second)
	ctx := ctxFor(t, 30*time.Second)
	s := sink.NewMemory(sink.MemoryConfig{Verifier: b})
	write := func(l leasehold.Lease, value string) error {
		return s.Apply(ctx, sink.Effect{Stamp: l.Stamp("report." + value), Subject: "report", Data: []byte(value)})
	}

	la, err := a.Lock(ctx, "report-generator", coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	if err := write(la.Info(), "a-1"); err != nil {
		t.Fatal(err)
	}
	got := lockInBackground(t, ctx, bw, "report-generator")
	select {
	case <-la.Done():
	case <-ctx.Done():
		t.Fatal("A's context outlived its lease")
	}
	var lost *coordinator.LostError
	if !errors.As(context.Cause(la.Context()), &lost) || lost.Lock != "report-generator" || !strings.Contains(lost.Error(), `lock "report-generator"`) {
		t.Fatalf("A's cause: %v", context.Cause(la.Context()))
	}
	r := <-got
	if r.err != nil {
		t.Fatalf("B's Lock: %v", r.err)
	}
	lb := r.l
	defer lb.Release(ctx)
	if err := write(lb.Info(), "b-1"); err != nil {
		t.Fatal(err)
	}
	err = write(la.Info(), "a-2")
	if !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("A's write after B's: %v, want a stale-epoch refusal", err)
	}
	if e, ok := s.Get("report"); !ok || string(e.Data) != "b-1" {
		t.Fatalf("the resource holds %q", e.Data)
	}
}

// Thousands of lock names in one bucket: 5,000 locks taken and released
// by 8 goroutines, every token distinct, every lock listed afterwards with
// its fenced epoch and no holder.
func TestManyLocks(t *testing.T) {
	t.Parallel()
	oneOf(t, busy)
	_, b := startBucket(t)
	ctx := ctxFor(t, 120*time.Second)
	const locks, workers = 5000, 8
	var (
		next   atomic.Int64
		tokens sync.Map
		wg     sync.WaitGroup
	)
	for w := range workers {
		c := newCoord(t, b, fmt.Sprintf("w%d", w), 10*time.Second)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= locks || ctx.Err() != nil {
					return
				}
				l, err := c.TryLock(ctx, fmt.Sprintf("account:%d", i), coordinator.ManualRenew())
				if err != nil {
					t.Error(err)
					return
				}
				if _, dup := tokens.LoadOrStore(l.Epoch(), i); dup {
					t.Errorf("token %d issued twice", l.Epoch())
				}
				if err := l.Release(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	st, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Locks) != locks || len(st.Findings) != 0 {
		t.Fatalf("snapshot lists %d locks and %d findings, want %d and none", len(st.Locks), len(st.Findings), locks)
	}
	for _, ls := range st.Locks {
		if ls.Holder != "" || ls.FencedEpoch == 0 {
			t.Fatalf("lock %+v after its release", ls)
		}
	}
}

// Snapshot and FenceLock on a held lock.
func TestFenceLock(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	ctx := ctxFor(t, 20*time.Second)
	la, err := newCoord(t, b, "a", 10*time.Second).TryLock(ctx, "nightly", coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	st, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Locks) != 1 || st.Locks[0].Name != "nightly" || st.Locks[0].Holder != "a" || st.Locks[0].Epoch != la.Epoch() || st.Locks[0].FencedEpoch != la.Epoch() {
		t.Fatalf("snapshot locks %+v", st.Locks)
	}
	res, err := newCoord(t, b, "operator", 10*time.Second).FenceLock(ctx, "nightly")
	if err != nil {
		t.Fatal(err)
	}
	if res.Previous.Holder != "a" || res.Epoch <= la.Epoch() {
		t.Fatalf("fence result %+v", res)
	}
	if err := la.Renew(ctx); !errors.Is(err, leasehold.ErrLeaseLost) {
		t.Fatalf("renew after the fence: %v", err)
	}
	if got, err := b.IssuedEpoch(ctx, la.Info().Fence()); err != nil || got != res.Epoch {
		t.Fatalf("IssuedEpoch after the fence = %d, %v; want %d", got, err, res.Epoch)
	}
}

// RunSingleton: two workers run one singleton. When the leader's lease is
// taken away, its fn's context ends (at the latest at its local deadline),
// a new leader's fn starts under a higher epoch, and the former leader
// campaigns again. Both return nil when their context ends.
func TestRunSingleton(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	ctx, cancel := context.WithCancel(ctxFor(t, 60*time.Second))
	defer cancel()
	type run struct {
		worker string
		epoch  leasehold.Epoch
		ended  chan error // the cause of fn's context's end
	}
	runs := make(chan run, 16)
	fn := func(name string) func(context.Context, *coordinator.Lease) error {
		return func(fctx context.Context, l *coordinator.Lease) error {
			r := run{worker: name, epoch: l.Epoch(), ended: make(chan error, 1)}
			runs <- r
			<-fctx.Done()
			r.ended <- context.Cause(fctx)
			return fctx.Err()
		}
	}
	done := make(chan error, 2)
	for _, name := range []string{"a", "b"} {
		c := newCoord(t, b, name, 2*time.Second)
		go func() { done <- c.RunSingleton(ctx, "leader", fn(name)) }()
	}
	first := <-runs
	if _, err := newCoord(t, b, "operator", 2*time.Second).FenceLock(ctx, "leader"); err != nil {
		t.Fatal(err)
	}
	select {
	case cause := <-first.ended:
		if !errors.Is(cause, leasehold.ErrLeaseLost) {
			t.Fatalf("the first leader's fn ended with %v, want a lost lease", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first leader's fn ran on after its lease was taken")
	}
	second := <-runs
	if second.epoch <= first.epoch {
		t.Fatalf("led by %s at %d, then by %s at %d", first.worker, first.epoch, second.worker, second.epoch)
	}
	cancel()
	for range 2 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("RunSingleton: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("RunSingleton did not return after its context ended")
		}
	}
	t.Logf("led by %s, then by %s after the fence", first.worker, second.worker)
}

// A lock key holding a record leasehold did not write does not keep the
// lock from everyone for ever: Lock takes it over once it has stayed
// unchanged for a TTL.
func TestLockTakesOverAForeignRecord(t *testing.T) {
	t.Parallel()
	_, b := startBucket(t)
	ctx := ctxFor(t, 20*time.Second)
	key := "lock." + coordinator.EncodeLockName("nightly")
	if _, err := b.KeyValue().Put(ctx, key, []byte(`{"holder":"ghost","token":"t","ttl_ms":1000}`)); err != nil {
		t.Fatal(err)
	}
	c := newCoord(t, b, "a", time.Second)
	if _, err := c.TryLock(ctx, "nightly"); !errors.Is(err, coordinator.ErrForeignRecord) {
		t.Fatalf("TryLock over a record without a TTL: %v", err)
	}
	l, err := c.Lock(ctx, "nightly")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if h, ok, err := c.LockHolder(ctx, "nightly"); err != nil || !ok || h.Holder != "a" {
		t.Fatalf("after the take-over: %+v, %v, %v", h, ok, err)
	}
}

type lockResult struct {
	l   *coordinator.Lease
	err error
}

// lockInBackground runs c.Lock(ctx, name) in a goroutine and hands its
// outcome over on the returned channel. The goroutine does not touch t:
// a test that fails before it reads the outcome ends while Lock still
// waits, and a report from there would come after the test has completed.
// When the test ends, the wait is called off and the goroutine waited
// for, so that it does not outlive the test.
func lockInBackground(t *testing.T, ctx context.Context, c *coordinator.Coordinator, name string) <-chan lockResult {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	got := make(chan lockResult, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		l, err := c.Lock(ctx, name)
		got <- lockResult{l, err}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return got
}
