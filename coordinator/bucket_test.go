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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// cycle acquires and releases partition p once and returns the epoch. An
// acquisition whose fence step outlasts its lease's deadline (a fail-over
// on a busy machine can take longer than the 2 s TTL these tests use) is
// lost, and counts as one more epoch issued: cycle acquires again.
func cycle(t *testing.T, c *coordinator.Coordinator, p leasehold.Partition) leasehold.Epoch {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	var l *coordinator.Lease
	for l == nil {
		var err error
		l, err = c.Acquire(ctx, p)
		switch {
		case err == nil:
		case errors.Is(err, coordinator.ErrHeld) || errors.Is(err, leasehold.ErrLeaseLost):
			select {
			case <-ctx.Done():
				t.Fatalf("acquire partition %d: %v", p, err)
			case <-time.After(50 * time.Millisecond):
			}
		default:
			t.Fatalf("acquire partition %d: %v", p, err)
		}
	}
	// Retry the release across a fail-over.
	for {
		err := l.Release(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("release: %v", err)
		}
	}
	return l.Epoch()
}

// I1: epochs strictly increase across a server restart.
func TestEpochsIncreaseAcrossRestart(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	b := provision(t, s.JetStream(t), 1)
	c := newCoord(t, b, "a", 2*time.Second)
	e1 := cycle(t, c, 0)
	e2 := cycle(t, c, 0)
	s.Restart(t)
	b = provision(t, s.JetStream(t), 1)
	c = newCoord(t, b, "a", 2*time.Second)
	e3 := cycle(t, c, 0)
	if !(e1 < e2 && e2 < e3) {
		t.Fatalf("epochs %d, %d, %d do not increase", e1, e2, e3)
	}
}

// I1: epochs strictly increase across the loss of the stream leader.
func TestEpochsIncreaseAcrossLeaderKill(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	js := cl.JetStream(t)
	b := provision(t, js, 3)
	c := newCoord(t, b, "a", 2*time.Second)
	var last leasehold.Epoch
	for round := range 3 {
		for range 3 {
			e := cycle(t, c, leasehold.Partition(round))
			if e <= last {
				t.Fatalf("round %d: epoch %d after %d", round, e, last)
			}
			last = e
		}
		leader := cl.StreamLeader(t, "KV_"+b.Name(), 10*time.Second)
		cl.Kill(leader)
		cl.StreamLeader(t, "KV_"+b.Name(), 20*time.Second)
		e := cycle(t, c, leasehold.Partition(round))
		if e <= last {
			t.Fatalf("after killing node %d: epoch %d after %d", leader, e, last)
		}
		last = e
		cl.Restart(t, leader)
		cl.WaitStreamCurrent(t, "KV_"+b.Name(), 30*time.Second)
	}
}

// I1: epochs strictly increase when the bucket is deleted and re-created,
// even when the old bucket issued revisions faster than the clock moves.
func TestEpochsIncreaseAcrossBucketRecreation(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 20*time.Second)
	b := provision(t, js, 1)
	c := newCoord(t, b, "a", 2*time.Second)
	before := cycle(t, c, 5)
	if err := js.DeleteStream(ctx, "KV_"+b.Name()); err != nil {
		t.Fatal(err)
	}
	b = provision(t, js, 1)
	after := cycle(t, newCoord(t, b, "a", 2*time.Second), 5)
	if after <= before {
		t.Fatalf("epoch %d after re-creation is not above %d", after, before)
	}

	// A floor far ahead of the clock (a bucket that issued many revisions)
	// carries over when passed as EpochFloor.
	floor := after + 1<<40
	if err := js.DeleteStream(ctx, "KV_"+b.Name()); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{EpochFloor: floor})
	if err != nil {
		t.Fatal(err)
	}
	if e := cycle(t, newCoord(t, b, "a", 2*time.Second), 5); e <= floor {
		t.Fatalf("epoch %d is not above the floor %d", e, floor)
	}
}

// I2: racing acquirers on the cluster never hold one partition together,
// whether the partition changes hands by release or by expiry. A holder
// that abandons its lease counts as holding it until its local deadline
// passes, which must come before the server lets anybody else in.
//
// A racer holds from when it records its acquisition until it starts its
// release or its local deadline passes, whichever comes first; a racer
// that records its acquisition inside another's span, with its own
// deadline still ahead, holds together with it. The spans are the racers'
// own, on one monotonic clock, so a racer the scheduler holds up is judged
// by its deadline, not by when it got round to letting go. Likewise a
// racer held up between the return of its Acquire and its record may find
// its own deadline gone by then, and the partition rightly with somebody
// else: it held nothing when it recorded, so it is not counted, and it
// does not take the place of the holder it found.
func TestNeverTwoHolders(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	b := provision(t, cl.JetStream(t), 3)
	const racers, target = 8, 60
	var mu sync.Mutex
	var cur struct {
		racer         int // 0: nobody yet; i+1: racer i
		epoch         leasehold.Epoch
		deadline, let time.Time
	}
	var violations, wins, late, lapsed atomic.Int32
	var epochs sync.Map
	ctx := ctxFor(t, 120*time.Second)
	var wg sync.WaitGroup
	for i := range racers {
		js := cl.JetStream(t)
		bi, err := coordinator.OpenBucket(ctx, js, b.Name())
		if err != nil {
			t.Fatal(err)
		}
		c := newCoord(t, bi, "racer-"+string(rune('a'+i)), time.Second)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for wins.Load() < target && ctx.Err() == nil {
				l, err := c.Acquire(ctx, 9, coordinator.ManualRenew())
				if err != nil {
					// An acquisition whose local deadline passed before it
					// was done (a loaded machine, the 1 s TTL) holds
					// nothing: it ends lost, as it must, and is no overlap.
					var lost *coordinator.LostError
					switch {
					case errors.As(err, &lost) && lost.Reason == coordinator.LostDeadline:
						lapsed.Add(1)
					case !errors.Is(err, coordinator.ErrHeld) && ctx.Err() == nil:
						t.Errorf("racer %d: %v", i, err)
					}
					time.Sleep(time.Duration(i) * time.Millisecond)
					continue
				}
				n := wins.Add(1)
				if _, dup := epochs.LoadOrStore(l.Epoch(), i); dup {
					t.Errorf("epoch %d issued twice", l.Epoch())
				}
				mu.Lock()
				// Read under the lock, so that the records come in the
				// order of their times.
				now := time.Now()
				if now.Before(l.Deadline()) {
					if cur.racer != 0 {
						end := cur.deadline
						if !cur.let.IsZero() && cur.let.Before(end) {
							end = cur.let
						}
						if now.Before(end) {
							violations.Add(1)
							t.Errorf("racer %d acquired epoch %d %v before racer %d stopped holding epoch %d", i, l.Epoch(), end.Sub(now), cur.racer-1, cur.epoch)
						}
					}
					cur.racer, cur.epoch, cur.deadline, cur.let = i+1, l.Epoch(), l.Deadline(), time.Time{}
				} else {
					late.Add(1)
				}
				mu.Unlock()
				if n%10 == 9 {
					<-l.Done() // abandoned: held until the local deadline
					continue
				}
				time.Sleep(2 * time.Millisecond)
				mu.Lock()
				if cur.racer == i+1 && cur.epoch == l.Epoch() {
					cur.let = time.Now()
				}
				mu.Unlock()
				// A release that gets no answer in time, or comes after the
				// local deadline (the scheduler held the racer up), is no
				// fault here: the lease expires on its own.
				if err := l.Release(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, leasehold.ErrLeaseLost) {
					t.Errorf("racer %d release: %v", i, err)
				}
			}
		}()
	}
	wg.Wait()
	if v := violations.Load(); v != 0 {
		t.Fatalf("%d times two racers held the partition together", v)
	}
	if wins.Load() < target {
		t.Fatalf("only %d acquisitions before the deadline", wins.Load())
	}
	t.Logf("%d acquisitions, no overlap; %d recorded after their own deadline; %d lapsed before they were done", wins.Load(), late.Load(), lapsed.Load())
}

func TestBucketWithWrongConfigIsRefused(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx := ctxFor(t, 10*time.Second)
	// A stock KV bucket: history 5, no per-key TTL, memory storage.
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "stock", History: 5, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	_, err := coordinator.OpenBucket(ctx, js, "stock")
	if !errors.Is(err, coordinator.ErrBucketConfig) {
		t.Fatalf("OpenBucket: %v, want ErrBucketConfig", err)
	}
	for _, want := range []string{"history is 5", "per-key TTLs", "memory", "first-sequence floor", "leasehold init"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "stock"}); !errors.Is(err, coordinator.ErrBucketConfig) {
		t.Fatalf("Provision over a stock bucket: %v", err)
	}
	// A good bucket asked for with more replicas than it has.
	provision(t, js, 1)
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Replicas: 3}); !errors.Is(err, coordinator.ErrBucketConfig) {
		t.Fatalf("R1 bucket provisioned as R3: %v", err)
	}
	if _, err := coordinator.OpenBucket(ctx, js, "missing"); err == nil || !strings.Contains(err.Error(), "leasehold init") {
		t.Fatalf("missing bucket: %v", err)
	}
	if err := (coordinator.BucketConfig{Bucket: "a.b", MarkerTTL: 1500 * time.Millisecond}).Validate(); err == nil {
		t.Fatal("bad bucket config accepted")
	}
}

func TestGarbledLeaseRecord(t *testing.T) {
	t.Parallel()
	js, b := startBucket(t)
	ctx := ctxFor(t, 10*time.Second)
	kv, _ := js.KeyValue(ctx, b.Name())
	if _, err := kv.PutString(ctx, "partition.4", "not json"); err != nil {
		t.Fatal(err)
	}
	_, err := newCoord(t, b, "a", 2*time.Second).Acquire(ctx, 4)
	var foreign *coordinator.ForeignRecordError
	if !errors.As(err, &foreign) || !errors.Is(err, coordinator.ErrForeignRecord) || foreign.Key != "partition.4" || !strings.Contains(err.Error(), "leasehold fence 4") {
		t.Fatalf("acquire over garbage: %v, want a ForeignRecordError saying how to repair it", err)
	}
	if _, err := b.FenceRecords().PutString(ctx, "partition.6", "{garbage"); err != nil {
		t.Fatal(err)
	}
	_, err = newCoord(t, b, "a", 2*time.Second).Acquire(ctx, 6)
	if err == nil || !strings.Contains(err.Error(), "partition.6") || !strings.Contains(err.Error(), "leasehold fence 6") {
		t.Fatalf("acquire over a garbled fence record: %v", err)
	}
	// The failed acquisition did not leave the partition held.
	if e, err := kv.Get(ctx, "partition.6"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("partition 6 after a failed acquisition: %v, %v", e, err)
	}
}

func TestNATSUnreachable(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	nc, err := nats.Connect(s.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	s.Shutdown()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	_, err = coordinator.Provision(ctx, js, coordinator.BucketConfig{})
	if err == nil {
		t.Fatal("Provision succeeded with no server")
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("Provision took %v to fail", time.Since(start))
	}
	t.Log(err)
}

// Lookup reads through the stream leader: on a 3-node cluster, a value
// written through the leader's node is seen at once by a reader connected
// to a follower, where a direct get (kv.Get) may still miss it. Keys with
// no value read as absent.
func TestLookupSeesTheLeadersValue(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	b := provision(t, cl.JetStream(t), 3)
	ctx := ctxFor(t, 60*time.Second)
	leader := cl.StreamLeader(t, "KV_"+b.Name(), 10*time.Second)
	follower := (leader + 1) % 3
	w, err := coordinator.OpenBucket(ctx, cl.Node(leader).JetStream(t), b.Name())
	if err != nil {
		t.Fatal(err)
	}
	r, err := coordinator.OpenBucket(ctx, cl.Node(follower).JetStream(t), b.Name())
	if err != nil {
		t.Fatal(err)
	}
	missed := 0
	for i := range 300 {
		key, want := fmt.Sprintf("k%d", i), fmt.Sprintf("v%d", i)
		if _, err := w.KeyValue().Put(ctx, key, []byte(want)); err != nil {
			t.Fatal(err)
		}
		got, ok, err := r.Lookup(ctx, key)
		if err != nil || !ok || string(got) != want {
			t.Fatalf("Lookup(%s) from node %d right after the write = %q, %v, %v; want %q", key, follower, got, ok, err, want)
		}
		if e, err := r.KeyValue().Get(ctx, key); err != nil || string(e.Value()) != want {
			missed++
		}
	}
	t.Logf("direct gets from the follower's connection that missed a value just written: %d of 300", missed)

	if _, ok, err := r.Lookup(ctx, "never-written"); ok || err != nil {
		t.Errorf("Lookup of a key never written: ok %v, err %v", ok, err)
	}
	if err := w.KeyValue().Delete(ctx, "k1"); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := r.Lookup(ctx, "k1"); ok || err != nil {
		t.Errorf("Lookup of a deleted key: ok %v, err %v", ok, err)
	}
}
