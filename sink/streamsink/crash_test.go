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

// A runner killed mid-batch, once after republishing and before saving
// its progress and once after saving and before acking, is followed by one
// that finishes the log: nothing is applied twice, nothing is lost, and no
// stale effect lands.
func TestCrashMidBatch(t *testing.T) {
	srv := natstest.Start(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	cfg := streamsink.Config{Prefix: "crash", Batch: 16, AckWait: time.Second, Logger: quiet()}
	// Create the log and its consumer before anything is published.
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	want, stale, last := history(t, ctx, js, "crash")

	for _, point := range []string{"delivered", "saved"} {
		r, err := streamsink.New(ctx, srv.JetStream(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		var batches atomic.Int32
		crash := errors.New("killed")
		r.SetHook(func(p string) error {
			if p == point && batches.Add(1) == 3 {
				return crash
			}
			return nil
		})
		err = run(t, r).waitDone(ctx)
		if !errors.Is(err, crash) {
			t.Fatalf("runner killed at %q: Run = %v", point, err)
		}
		got, err := downstream(ctx, js, "crash-fenced")
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 || r.Position() >= last {
			t.Fatalf("killed at %q: %d effects downstream at position %d of %d; the kill was not mid-log", point, len(got), r.Position(), last)
		}
		t.Logf("killed at %q: position %d, %d effects downstream", point, r.Position(), len(got))
	}
	final := start(t, srv.JetStream(t), cfg)
	if err := final.WaitPosition(ctx, last); err != nil {
		t.Fatal(err)
	}
	checkApplied(t, ctx, js, "crash-fenced", want, stale)
	for p := range leasehold.Partition(4) {
		if m := final.Fence(leasehold.FenceID{Scope: "crash", Partition: p}).Epoch; m != 7 {
			t.Errorf("partition %d: max %d, want 7", p, m)
		}
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
	srv := natstest.Start(t, natstest.Listen())
	ctx := ctxFor(t, 2*time.Minute)
	js := srv.JetStream(t)
	logs := &lockedBuffer{retry: make(chan struct{}, 1)}
	cfg := streamsink.Config{Prefix: "restart", Batch: 4, AckWait: time.Second, MaxBackoff: 200 * time.Millisecond, RequestTimeout: 500 * time.Millisecond,
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
	cfg := streamsink.Config{Prefix: "hand"}
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
	if testing.Short() {
		t.Skip("starts a three-node cluster")
	}
	cl := natstest.StartCluster(t)
	ctx := ctxFor(t, 2*time.Minute)
	js := cl.JetStream(t)
	cfg := streamsink.Config{Prefix: "resume", Replicas: 3, Batch: 16, AckWait: time.Second, Logger: quiet()}
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
