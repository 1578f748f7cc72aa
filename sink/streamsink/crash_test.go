package streamsink_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// history publishes, for each of four partitions, a former holder's
// effects, the new holder's barrier, more effects of the former holder
// (stale from then on) and the new holder's effects, interleaved. It
// returns the keys that must be applied, the stale ones, and the log
// position of the last message.
func history(t *testing.T, ctx context.Context, js jetstream.JetStream, prefix string) (want, stale map[string]bool, last uint64) {
	t.Helper()
	want, stale = map[string]bool{}, map[string]bool{}
	pub := func(p leasehold.Partition, e leasehold.Epoch, key string, barrier bool) {
		h := nats.Header{}
		leasehold.Stamp{Scope: prefix, Partition: p, Epoch: e, Acquisition: fmt.Sprintf("a%d", e), Key: key, Worker: fmt.Sprintf("w%d", e)}.SetHeader(h)
		subject := fmt.Sprintf("%s.out.p%d", prefix, p)
		if barrier {
			h.Set(leasehold.HeaderBarrier, "1")
		}
		for {
			ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: subject, Header: h, Data: []byte(key)})
			if err == nil {
				last = ack.Sequence
				return
			}
			if ctx.Err() != nil {
				t.Fatalf("publish: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for i := range 50 {
		for p := range leasehold.Partition(4) {
			key := fmt.Sprintf("%s.p%d.%d", prefix, p, i)
			switch {
			case i < 20:
				pub(p, 5, key, false)
				want[key] = true
			case i == 20:
				pub(p, 7, leasehold.BarrierKey(prefix, p, 7), true)
				fallthrough
			case i < 30:
				pub(p, 5, key, false)
				stale[key] = true
			default:
				pub(p, 7, key, false)
				want[key] = true
			}
		}
	}
	return want, stale, last
}

// checkApplied requires every wanted key exactly once downstream and no
// stale key at all.
func checkApplied(t *testing.T, ctx context.Context, js jetstream.JetStream, stream string, want, stale map[string]bool) {
	t.Helper()
	got, err := downstream(ctx, js, stream)
	if err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	for _, e := range got {
		count[e.Stamp.Key]++
	}
	for k := range want {
		if count[k] != 1 {
			t.Errorf("effect %s applied %d times, want once", k, count[k])
		}
	}
	for k := range stale {
		if count[k] != 0 {
			t.Errorf("stale effect %s applied %d times", k, count[k])
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d effects downstream, want %d", len(got), len(want))
	}
}

// refusals records the keys every runner of a test refused, by scope.
type refusals struct {
	mu   sync.Mutex
	keys map[string]sink.Decision // "<scope> <key>"
}

func (r *refusals) Decided(_ context.Context, d sink.Decision) {
	if !d.Outcome.Dropped() {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.keys == nil {
		r.keys = map[string]sink.Decision{}
	}
	r.keys[d.Stamp.Scope+" "+d.Stamp.Key] = d
}

func (r *refusals) of(scope, key string) (sink.Decision, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok := r.keys[scope+" "+key]
	return d, ok
}

// A runner killed mid-batch is followed by one that finishes the log:
// nothing is applied twice, nothing is lost, no stale effect lands, and no
// effect that must be applied is ever refused. The kills: after
// republishing and before saving anything; after saving the fence shards
// of the barriers' batch and before saving its position (the next runner
// finds fences above the saved position and must judge the batch's
// earlier effects as of their own positions); after saving and before
// acking.
func TestCrashMidBatch(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	refused := &refusals{}
	cfg := streamsink.Config{Prefix: "crash", Provision: true, Batch: 16, AckWait: time.Second, Logger: quiet(), Observer: refused}
	// Create the log and its consumer before anything is published.
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	want, stale, last := history(t, ctx, js, "crash")

	// A batch holds what has arrived when it is taken, so the batches
	// of a loaded machine can be a message each. The first kill comes
	// once every partition's first effect (positions 1 to 4) is saved:
	// the "fenced" kill after it is then in the batch of the barriers.
	for _, kill := range []struct {
		point string
		after uint64 // the saved position from which batches count
		batch int32
	}{{"delivered", 4, 3}, {"fenced", 0, 1}, {"saved", 0, 3}} {
		r, err := streamsink.New(ctx, srv.JetStream(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		var batches atomic.Int32
		crash := errors.New("killed")
		r.SetHook(func(p string) error {
			if p == kill.point && r.Position() >= kill.after && batches.Add(1) == kill.batch {
				return crash
			}
			return nil
		})
		err = run(t, r).waitDone(ctx)
		if !errors.Is(err, crash) {
			t.Fatalf("runner killed at %q: Run = %v", kill.point, err)
		}
		got, err := downstream(ctx, js, "crash-fenced")
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 || r.Position() >= last {
			t.Fatalf("killed at %q: %d effects downstream at position %d of %d; the kill was not mid-log", kill.point, len(got), r.Position(), last)
		}
		t.Logf("killed at %q: position %d, %d effects downstream", kill.point, r.Position(), len(got))
		if kill.point == "fenced" {
			// The barriers' fences are saved, their position is not: a
			// runner started now resumes before the barriers, at epoch 5.
			next, err := streamsink.New(ctx, srv.JetStream(t), cfg)
			if err != nil {
				t.Fatal(err)
			}
			if next.Position() != r.Position() {
				t.Fatalf("after the kill between fences and position: resumes at %d, want the saved %d", next.Position(), r.Position())
			}
			for p := range leasehold.Partition(4) {
				if f := next.Fence(leasehold.FenceID{Scope: "crash", Partition: p}); f.Epoch != 5 {
					t.Fatalf("after the kill between fences and position: partition %d at %+v, want epoch 5 as of the saved position", p, f)
				}
			}
		}
	}
	final := start(t, srv.JetStream(t), cfg)
	if err := final.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	checkApplied(t, ctx, js, "crash-fenced", want, stale)
	for p := range leasehold.Partition(4) {
		if f := final.Fence(leasehold.FenceID{Scope: "crash", Partition: p}); f.Epoch != 7 || f.Acquisition != "a7" {
			t.Errorf("partition %d: fence %+v, want epoch 7 of acquisition a7", p, f)
		}
	}
	for k := range want {
		if d, ok := refused.of("crash", k); ok {
			t.Errorf("effect %s, to be applied, was refused at position %d: %v", k, d.Position, d.Err)
		}
	}
	for k := range stale {
		if _, ok := refused.of("crash", k); !ok {
			t.Errorf("stale effect %s was never refused", k)
		}
	}
}

// A message that precedes a barrier in the log, and is redelivered after
// the barrier's batch was decided and its fence saved, is judged by its
// position: the fence as it stood before the barrier admits it. A runner
// that judged it by the fence alone would refuse a committed effect.
func TestRedeliveryJudgedByPosition(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	const scope = "redeliver"
	id := leasehold.FenceID{Scope: scope, Partition: 0}
	var mu sync.Mutex
	handed := map[string]int{}
	rec := &positions{}
	cfg := streamsink.Config{Prefix: scope, Provision: true, Batch: 2, AckWait: time.Second, Logger: quiet(), Observer: rec,
		Handler: func(_ context.Context, e sink.Effect) error {
			mu.Lock()
			defer mu.Unlock()
			handed[e.Stamp.Key]++
			return nil
		}}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	pub := func(e leasehold.Epoch, key string, barrier bool) uint64 {
		h := nats.Header{}
		leasehold.Stamp{Scope: scope, Partition: 0, Epoch: e, Acquisition: fmt.Sprintf("a%d", e), Key: key, Worker: fmt.Sprintf("w%d", e)}.SetHeader(h)
		if barrier {
			h.Set(leasehold.HeaderBarrier, "1")
		}
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: scope + ".out.x", Header: h, Data: []byte(key)})
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	before := pub(5, "before-barrier", false)
	barrier := pub(7, leasehold.BarrierKey(scope, 0, 7), true)

	// The first runner decides both in one batch, hands the effect over,
	// saves the barrier's fence and dies before it saves the position.
	first, err := streamsink.New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	crash := errors.New("killed")
	first.SetHook(func(p string) error {
		if p == "fenced" {
			return crash
		}
		return nil
	})
	if err := run(t, first).waitDone(ctx); !errors.Is(err, crash) {
		t.Fatalf("first runner: Run = %v, want the kill after the fences were saved", err)
	}
	// It reported its decisions before the save (at least once, never
	// none): what follows is the second runner's decision.
	rec.reset()

	// The second finds the barrier's fence saved above its position, and
	// gets both messages again when their ack wait runs out.
	second := start(t, srv.JetStream(t), cfg)
	if err := second.WaitPosition(ctx, barrier); err != nil {
		t.Fatal(err)
	}
	d, ok := rec.at(before)
	if !ok || d.Outcome != sink.Accepted || d.Max != 5 {
		t.Fatalf("the redelivered effect that precedes the barrier: %+v, want Accepted at epoch 5", d)
	}
	if f := second.Fence(id); f.Epoch != 7 || f.Acquisition != "a7" {
		t.Fatalf("fence after the barrier: %+v, want epoch 7 of a7", f)
	}
	// After the barrier, the former holder is refused and the new one is
	// not.
	zombie := pub(5, "after-barrier", false)
	holder := pub(7, "new-holder", false)
	if err := second.WaitPosition(ctx, holder); err != nil {
		t.Fatal(err)
	}
	if d, _ := rec.at(zombie); d.Outcome != sink.Stale || d.Max != 7 {
		t.Fatalf("the former holder's effect after the barrier: %+v, want Stale under 7", d)
	}
	mu.Lock()
	defer mu.Unlock()
	if handed["before-barrier"] < 1 || handed["new-holder"] != 1 || handed["after-barrier"] != 0 {
		t.Fatalf("handed over %v: want before-barrier (again after the crash), new-holder once, after-barrier never", handed)
	}
	if n := second.Dropped(id); n != 1 {
		t.Fatalf("Dropped = %d, want 1 (the effect after the barrier)", n)
	}
}

// waitDone waits for Run to return by itself.
func (rr *running) waitDone(ctx context.Context) error {
	select {
	case err := <-rr.done:
		close(rr.done)
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NATS restarts under a running runner, in the middle of the log: it
// backs off, reconnects and finishes the log.
func TestNATSRestart(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	logs := &lockedBuffer{retry: make(chan struct{}, 1)}
	cfg := streamsink.Config{Prefix: "restart", Provision: true, Batch: 4, AckWait: time.Second, MaxBackoff: 200 * time.Millisecond, RequestTimeout: 500 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, nil))}
	r, err := streamsink.New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	want, stale, last := history(t, ctx, js, "restart")
	// Hold the runner at its fifth batch until the server is down.
	var batches atomic.Int32
	reached, resume := make(chan struct{}), make(chan struct{})
	r.SetHook(func(point string) error {
		if point == "delivered" && batches.Add(1) == 5 {
			close(reached)
			<-resume
		}
		return nil
	})
	run(t, r)
	select {
	case <-reached:
	case <-ctx.Done():
		t.Fatal("the runner did not reach its fifth batch")
	}
	srv.Shutdown()
	close(resume) // it now saves progress against a server that is down
	select {
	case <-logs.retry:
	case <-ctx.Done():
		t.Fatal("the runner did not notice the server was down")
	}
	srv.Restart(t)
	if err := r.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	checkApplied(t, ctx, js, "restart-fenced", want, stale)
	if !strings.Contains(logs.String(), "save progress") {
		t.Fatalf("the runner met the outage elsewhere than saving its progress:\n%s", logs.String())
	}
}

// lockedBuffer collects log lines and signals the first retry.
type lockedBuffer struct {
	mu    sync.Mutex
	b     bytes.Buffer
	retry chan struct{}
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if bytes.Contains(p, []byte("retrying")) {
		select {
		case l.retry <- struct{}{}:
		default:
		}
	}
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// With a Handler (or a BatchHandler), accepted effects are handed over in
// log order, once each even when a call fails and is retried, and stale
// ones never are.
func TestHandler(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"handler", "batch"} {
		t.Run(mode, func(t *testing.T) { testHandler(t, mode) })
	}
}

func testHandler(t *testing.T, mode string) {
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	var mu sync.Mutex
	seen := map[string]int{}
	var order []leasehold.Epoch
	var failOnce atomic.Bool
	take := func(e sink.Effect) {
		seen[e.Stamp.Key]++
		if e.Stamp.Partition == 0 {
			order = append(order, e.Stamp.Epoch)
		}
	}
	cfg := streamsink.Config{Prefix: "hand", Provision: true}
	if mode == "batch" {
		cfg.BatchHandler = func(ctx context.Context, es []sink.Effect) error {
			if !failOnce.Swap(true) {
				return errors.New("the handler's database blinked")
			}
			mu.Lock()
			defer mu.Unlock()
			for _, e := range es {
				take(e)
			}
			return nil
		}
	} else {
		cfg.Handler = func(ctx context.Context, e sink.Effect) error {
			if !failOnce.Swap(true) {
				return errors.New("the handler's database blinked")
			}
			mu.Lock()
			defer mu.Unlock()
			take(e)
			return nil
		}
	}
	r := start(t, js, cfg)
	want, stale, last := history(t, ctx, js, "hand")
	if err := r.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for k := range want {
		if seen[k] != 1 {
			t.Errorf("effect %s handed over %d times, want once", k, seen[k])
		}
	}
	for k := range stale {
		if seen[k] != 0 {
			t.Errorf("stale effect %s handed over", k)
		}
	}
	for i := 1; i < len(order); i++ {
		if order[i] < order[i-1] {
			t.Fatalf("partition 0 handed over out of log order: %v", order)
		}
	}
	if n := r.Dropped(leasehold.FenceID{Scope: "hand", Partition: 0}); n != 10 {
		t.Errorf("Dropped(0) = %d, want 10", n)
	}
}

// On a 3-node cluster, a runner started right after another stopped, on a
// connection to a node that does not lead the state bucket, resumes at the
// saved position with the saved fences: it reads them through the leader,
// not from a replica that may not have the last save yet.
func TestResumeOnAnotherNode(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a three-node cluster")
	}
	cl := natstest.StartCluster(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := cl.JetStream(t)
	cfg := streamsink.Config{Prefix: "resume", Provision: true, Replicas: 3, Batch: 16, AckWait: time.Second, Logger: quiet()}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	want, stale, last := history(t, ctx, js, "resume")
	first := start(t, js, cfg)
	if err := first.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	if err := first.stop(); err != nil {
		t.Fatal(err)
	}
	leader := cl.StreamLeader(t, "KV_"+"resume-sink-state", 10*time.Second)
	for _, node := range []int{(leader + 1) % 3, (leader + 2) % 3} {
		r, err := streamsink.New(ctx, cl.Node(node).JetStream(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if r.Position() != last {
			t.Fatalf("runner on node %d resumes at %d, want the saved %d", node, r.Position(), last)
		}
		for p := range leasehold.Partition(4) {
			if m := r.Fence(leasehold.FenceID{Scope: "resume", Partition: p}).Epoch; m != 7 {
				t.Errorf("runner on node %d: partition %d max %d, want the saved 7", node, p, m)
			}
		}
	}
	checkApplied(t, ctx, js, "resume-fenced", want, stale)
}

// A runner killed right after it saved a batch's position has reported
// the batch's refusals already: the next runner acks the batch's messages
// as at or below the saved position, without a decision, and refusals
// reported only after the save would never be counted, logged or traced
// (I3).
func TestCrashAfterSaveStillReportsRefusals(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	refused := &refusals{}
	// One batch holds the whole history, its stale effects included.
	cfg := streamsink.Config{Prefix: "unreported", Provision: true, Batch: 256, AckWait: time.Second, Logger: quiet(), Observer: refused}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	want, stale, last := history(t, ctx, js, "unreported")
	first, err := streamsink.New(ctx, srv.JetStream(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	crash := errors.New("killed")
	first.SetHook(func(p string) error {
		if p == "saved" {
			return crash
		}
		return nil
	})
	if err := run(t, first).waitDone(ctx); !errors.Is(err, crash) {
		t.Fatalf("Run = %v, want the kill after the save", err)
	}
	final := start(t, srv.JetStream(t), cfg)
	if err := final.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	checkApplied(t, ctx, js, "unreported-fenced", want, stale)
	for k := range stale {
		if _, ok := refused.of("unreported", k); !ok {
			t.Errorf("stale effect %s was never refused", k)
		}
	}
}
