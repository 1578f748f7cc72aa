package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
)

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// longest returns a legal scope of MaxScopeLen bytes that starts with
// prefix and holds every byte JSON or HTML escaping could lengthen.
func longest(prefix string) string {
	s := prefix + `"\<>&`
	return s + strings.Repeat("x", leasehold.MaxScopeLen-len(s))
}

// worstRise is a history entry at its largest: position, epoch,
// acquisition and holder (a Leasehold-Worker header far above any worker
// ID, which the fence cuts to maxHolderLen).
func worstRise(at uint64, e leasehold.Epoch, acq byte) rise {
	return rise{At: at, Epoch: e, Acquisition: acquisitions[acq], Holder: worstHolder}
}

var (
	worstHolder  = holderOf(strings.Repeat(`"`, 10_000))
	acquisitions = map[byte]string{
		'a': strings.Repeat("a", leasehold.MaxAcquisitionLen),
		'b': strings.Repeat("b", leasehold.MaxAcquisitionLen),
	}
)

// The saved state of 65,536 partitions of one scope, with the longest
// scope, acquisition and holder, each fence with two history entries (a
// rise above the saved position, the most a shard holds), stays within
// the shard bound in every key, and reads back.
func TestStateSizeBound(t *testing.T) {
	if testing.Short() || raceDetector {
		// It checks sizes, not concurrency; the race detector makes it
		// take a minute.
		t.Skip("writes and reads 4096 shards of 65,536 fences: run without -short and -race")
	}
	srv := natstest.Start(t)
	ctx := testCtx(t, 5*time.Minute)
	js := srv.JetStream(t)
	cfg := Config{Prefix: "size", Provision: true, Logger: slog.New(slog.DiscardHandler)}
	r, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	scope := longest("jobs")
	const base = math.MaxUint64 - 1<<20 // positions near the largest
	r.seq = base
	w := &work{seq: base + leasehold.MaxPartitions}
	for p := range leasehold.Partition(leasehold.MaxPartitions) {
		id := leasehold.FenceID{Scope: scope, Partition: p}
		if err := w.room(r.fences, id, "k", r.cfg.MaxFences); err != nil {
			t.Fatalf("partition %d: %v", p, err)
		}
		r.fences.add(id, worstRise(base, leasehold.MaxEpoch-1, 'a'))
	}
	for p := range leasehold.Partition(leasehold.MaxPartitions) {
		w.raise(r.fences, leasehold.FenceID{Scope: scope, Partition: p}, worstRise(base+1+uint64(p), leasehold.MaxEpoch, 'b'))
	}
	written, err := r.save(ctx, w)
	if err != nil {
		t.Fatal(err)
	}
	if len(written) != numShards {
		t.Fatalf("wrote %d shards, want all %d", len(written), numShards)
	}
	var total, largest int
	for k := range numShards {
		e, err := r.stateKV.Get(ctx, r.shardKey(k))
		if err != nil {
			t.Fatalf("shard %d: %v", k, err)
		}
		n := len(e.Value())
		total += n
		largest = max(largest, n)
		if bound := shardEnvelope + r.fences.reserved[k] + w.extra[k]; n > bound {
			t.Errorf("shard %d holds %d bytes, above the %d its fences reserve", k, n, bound)
		}
	}
	if largest > shardBytes {
		t.Fatalf("the largest shard holds %d bytes, above the bound of %d", largest, shardBytes)
	}
	if max := js.Conn().MaxPayload(); int64(largest) > max/4 {
		t.Fatalf("the largest shard holds %d bytes, not well under the max payload of %d", largest, max)
	}
	t.Logf("65536 fences, two entries each: %d shards, largest %d bytes (bound %d), mean %d, total %d",
		numShards, largest, shardBytes, total/numShards, total)

	r.fences.commit(w, written, w.seq)
	again, err := New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if again.Position() != w.seq || again.Fences() != leasehold.MaxPartitions {
		t.Fatalf("read back position %d and %d fences, want %d and %d", again.Position(), again.Fences(), w.seq, leasehold.MaxPartitions)
	}
	for _, p := range []leasehold.Partition{0, 1, 4095, 65535} {
		id := leasehold.FenceID{Scope: scope, Partition: p}
		if got, want := again.Fence(id), w.raised[id].state(); got != want {
			t.Fatalf("fence %d read back as %+v, want %+v", p, got, want)
		}
	}
	// Saved again with nothing raised, each fence keeps one entry.
	total = 0
	for k := range numShards {
		total += len(encodeShard((&work{}).history(again.fences, k, again.seq)))
	}
	t.Logf("65536 fences, one entry each: total %d bytes", total)
}

// Fences of as many scopes of the longest name fill one shard until its
// bound: the next is refused with a FenceLimitError naming the shard, and
// the full shard, with two worst-case entries per fence, is within the
// bound.
func TestShardFull(t *testing.T) {
	tab := newFenceTable(numShards)
	w := &work{}
	var ids []leasehold.FenceID
	for i := 0; ; i++ {
		id := leasehold.FenceID{Scope: longest(fmt.Sprintf("s%d-", i)), Partition: leasehold.MaxPartitions - 1}
		if shardOf(id, numShards) != 0 {
			continue
		}
		err := w.room(tab, id, "k", MaxFencesLimit)
		if err != nil {
			var le *FenceLimitError
			if !errors.As(err, &le) || !le.Shard || !errors.Is(err, ErrFenceLimit) || !strings.Contains(err.Error(), "shard") {
				t.Fatalf("the refusal %v does not say the shard is full", err)
			}
			break
		}
		tab.add(id, worstRise(math.MaxUint64-1, leasehold.MaxEpoch-1, 'a'))
		ids = append(ids, id)
	}
	for _, id := range ids {
		w.raise(tab, id, worstRise(math.MaxUint64, leasehold.MaxEpoch, 'b'))
	}
	n := len(encodeShard(w.history(tab, 0, math.MaxUint64-1)))
	if n > shardBytes {
		t.Fatalf("a full shard of %d fences takes %d bytes, above the bound of %d", len(ids), n, shardBytes)
	}
	t.Logf("a shard holds %d fences of distinct longest scopes: %d bytes of %d", len(ids), n, shardBytes)
	// Spread evenly, the shards hold MaxFencesLimit such fences.
	if len(ids)*numShards < MaxFencesLimit {
		t.Fatalf("%d fences per shard hold %d in all, below MaxFencesLimit %d", len(ids), len(ids)*numShards, MaxFencesLimit)
	}
}

// A shard that a runner saved and died before saving the position holds
// an entry above the saved position. The next runner ignores it and, even
// if it never raises that fence, writes the shard over before its position
// passes the entry: the dead runner's rise never comes to count.
func TestAheadEntryWrittenOver(t *testing.T) {
	srv := natstest.Start(t)
	ctx := testCtx(t, time.Minute)
	js := srv.JetStream(t)
	cfg := Config{Prefix: "ahead", Provision: true, Logger: slog.New(slog.DiscardHandler)}
	r, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ghost := leasehold.FenceID{Scope: "ahead", Partition: 1}
	k := shardOf(ghost, numShards)
	body := encodeShard(map[leasehold.FenceID][]rise{ghost: {{At: 3, Epoch: 9, Acquisition: "a9"}}})
	if _, err := r.stateKV.Put(ctx, r.shardKey(k), body); err != nil {
		t.Fatal(err)
	}
	r, err = New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if f := r.Fence(ghost); f != (leasehold.FenceState{}) || !r.fences.stale[k] {
		t.Fatalf("fence above the saved position read as %+v (stale %v), want none and the shard to be written over", f, r.fences.stale[k])
	}
	// Effects of another fence, in another shard, carry the position past
	// the ghost's entry.
	other := leasehold.FenceID{Scope: "ahead", Partition: 2}
	for shardOf(other, numShards) == k {
		other.Partition++
	}
	var last uint64
	for i := range 5 {
		h := nats.Header{}
		leasehold.Stamp{Scope: other.Scope, Partition: other.Partition, Epoch: 4, Acquisition: "a4", Key: fmt.Sprintf("k%d", i)}.SetHeader(h)
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "ahead.out.x", Header: h})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	err = r.WaitPosition(ctx, last)
	cancel()
	if rerr := <-done; rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	again, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if f := again.Fence(ghost); f != (leasehold.FenceState{}) {
		t.Fatalf("past the dead runner's entry, the fence reads %+v: its rise came to count", f)
	}
	if f := again.Fence(other); f.Epoch != 4 {
		t.Fatalf("the other fence reads %+v, want epoch 4", f)
	}
}

// A save retried while its earlier attempt is still being stored (its
// answer lost, the write not yet replicated) is refused at once on a
// replicated bucket with 10164, and the key still reads as before it.
// That is no other runner's save: the error is one the runner retries,
// and once the earlier attempt is stored, the retry finds it its own. The
// code before took it for another runner (ErrStateConflict), which ends
// Run.
func TestSaveRetriedWhileItsEarlierAttemptIsStored(t *testing.T) {
	cl := natstest.StartCluster(t, natstest.SyncAlways())
	ctx := testCtx(t, 2*time.Minute)
	js := cl.JetStream(t)
	r, err := New(ctx, js, Config{Prefix: "inflight", Provision: true, Replicas: 3, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := r.savePosition(ctx, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	refused := 0
	for seq := uint64(2); seq < 22; seq++ {
		// The earlier attempt: the same record, sent without waiting.
		msg := nats.NewMsg(r.kvSubject(r.positionKey()))
		msg.Data = r.encodePosition(seq)
		msg.Header.Set("Nats-Expected-Last-Subject-Sequence", fmt.Sprint(rev))
		if err := js.Conn().PublishMsg(msg); err != nil {
			t.Fatal(err)
		}
		for attempt := 0; ; attempt++ {
			nrev, err := r.savePosition(ctx, seq, rev)
			if err == nil {
				rev = nrev
				break
			}
			if errors.Is(err, ErrStateConflict) {
				t.Fatalf("position %d: the runner's own save in flight taken for another runner's: %v", seq, err)
			}
			if !isInFlight(err) || attempt > 1000 {
				t.Fatalf("position %d: %v", seq, err)
			}
			refused++
			time.Sleep(5 * time.Millisecond) // as the save loop's backoff does
		}
	}
	t.Logf("%d saves refused while their earlier attempt was in flight", refused)
	if refused == 0 {
		t.Log("no save met its earlier attempt in flight: the test did not exercise the case this time")
	}
}

// A reload that fails half-way (here: a shard key that is not leasehold's,
// read after good ones) leaves the runner's fences as they were, and a
// save after it (what ResumeAfterGap does while Run backs off) writes
// every fence back, not a half-loaded table's empty shards.
func TestFailedReloadKeepsTheFences(t *testing.T) {
	srv := natstest.Start(t)
	ctx := testCtx(t, time.Minute)
	js := srv.JetStream(t)
	cfg := Config{Prefix: "reload", Provision: true, Logger: slog.New(slog.DiscardHandler)}
	r, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := &work{seq: 30}
	for p := range leasehold.Partition(50) {
		w.raise(r.fences, leasehold.FenceID{Scope: "s", Partition: p}, rise{At: 20, Epoch: 3})
	}
	written, err := r.save(ctx, w)
	if err != nil {
		t.Fatal(err)
	}
	r.adopt(w, written)
	// As after a crash between the shard writes and the position write:
	// the position is at 10, the shards hold rises at 20, ahead of it.
	if r.rev, err = r.savePosition(ctx, 10, r.rev); err != nil {
		t.Fatal(err)
	}
	bad := r.shardKey(9999)
	if _, err := r.stateKV.Put(ctx, bad, []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := r.reload(ctx); err == nil {
		t.Fatal("reload read a shard that is not leasehold's")
	}
	if n := r.Fences(); n != 50 {
		t.Fatalf("after a failed reload the runner keeps %d fences, want 50", n)
	}
	written, err = r.save(ctx, &work{seq: r.seq})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range written {
		e, err := r.stateKV.Get(ctx, r.shardKey(k))
		if err != nil {
			t.Fatal(err)
		}
		if fs, _, err := decodeShard(e.Value(), k, r.fences.n, math.MaxUint64); err != nil || len(fs) == 0 {
			t.Errorf("shard %d saved after the failed reload holds %d fences (%v): its fences are lost", k, len(fs), err)
		}
	}
	if err := r.stateKV.Purge(ctx, bad); err != nil {
		t.Fatal(err)
	}
	again, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n := again.Fences(); n != 50 {
		t.Errorf("a runner started from the saved state keeps %d fences, want 50", n)
	}
	if got := again.Fence(leasehold.FenceID{Scope: "s", Partition: 7}); got.Epoch != 3 {
		t.Errorf("a runner started from the saved state has fence s/7 at epoch %d, want 3", got.Epoch)
	}
}

// Fence and Fences may be called from any goroutine, also while Run
// reloads the saved state (after a job group's save failed); under the
// race detector this checks that a reload replaces the table under mu.
func TestReloadBesideFenceReaders(t *testing.T) {
	srv := natstest.Start(t)
	ctx := testCtx(t, time.Minute)
	js := srv.JetStream(t)
	r, err := New(ctx, js, Config{Prefix: "readers", Provision: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	w := &work{seq: 10}
	for p := range leasehold.Partition(200) {
		w.raise(r.fences, leasehold.FenceID{Scope: "s", Partition: p}, rise{At: 5, Epoch: 3})
	}
	written, err := r.save(ctx, w)
	if err != nil {
		t.Fatal(err)
	}
	r.adopt(w, written)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if n := r.Fences(); n != 200 {
				t.Errorf("Fences during a reload: %d, want 200", n)
				return
			}
			if got := r.Fence(leasehold.FenceID{Scope: "s", Partition: 7}); got.Epoch != 3 {
				t.Errorf("Fence s/7 during a reload: epoch %d, want 3", got.Epoch)
				return
			}
		}
	}()
	for range 5 {
		if err := r.reload(ctx); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	<-done
}

// A key under the consumer's fence or applied prefix that is none of its
// shards stops the runner with an error that says to delete it; once
// deleted (or purged), the runner starts.
func TestStrayStateKeyDeletedAsAsked(t *testing.T) {
	srv := natstest.Start(t)
	ctx := testCtx(t, time.Minute)
	js := srv.JetStream(t)
	cfg := Config{Prefix: "stray", Provision: true, Logger: slog.New(slog.DiscardHandler)}
	r, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i, key := range []string{r.cfg.Consumer + ".fences.x1", r.cfg.Consumer + ".applied.99999"} {
		if _, err := r.stateKV.Put(ctx, key, []byte("x")); err != nil {
			t.Fatal(err)
		}
		_, err := New(ctx, js, cfg)
		if err == nil || !strings.Contains(err.Error(), "key "+key+" of") || !strings.Contains(err.Error(), "delete it") {
			t.Fatalf("New beside the stray key %s: %v, want an error that names it and says to delete it", key, err)
		}
		del := r.stateKV.Delete
		if i == 1 {
			del = r.stateKV.Purge
		}
		if err := del(ctx, key); err != nil {
			t.Fatal(err)
		}
		if _, err := New(ctx, js, cfg); err != nil {
			t.Fatalf("New once the stray key %s is gone: %v", key, err)
		}
	}
}
