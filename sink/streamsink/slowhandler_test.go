package streamsink_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
)

// A relay (`leasehold sink --kind http`) runs the runner with a handler
// that sends a request per effect, and keeps up with the log in batches of
// a message or two. One that is paused past its lock's TTL leaves the
// messages of its last pull unacked on the durable consumer; the relay
// that took over reads past them from the log (fill), and gets them again
// once the server redelivers them (after AckWait, or at once when they are
// handed back): a batch of messages all at or below the position it has
// decided. When a round of fence records that settles a job is ready at
// that very batch, what the round applies and drops must be delivered and
// reported like any other batch's: a job that is taken for applied and
// was never handed over is a lost job, and the saved position passes it.

// fetchGate holds the runner's fetcher before its next pull while it is
// shut, and says when the fetcher waits there.
type fetchGate struct {
	mu      sync.Mutex
	shut    bool
	open    chan struct{} // closed when the gate opens
	waiting chan struct{} // signalled when the fetcher waits at the gate
}

func newFetchGate() *fetchGate {
	return &fetchGate{open: make(chan struct{}), waiting: make(chan struct{}, 1)}
}

// close shuts the gate for the fetcher's next pull.
func (g *fetchGate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.shut {
		g.shut, g.open = true, make(chan struct{})
	}
}

// release opens the gate.
func (g *fetchGate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.shut {
		g.shut = false
		close(g.open)
	}
}

// hook is the runner's test hook: at "fetch", the fetcher waits while the
// gate is shut.
func (g *fetchGate) hook(point string) error {
	if point != "fetch" {
		return nil
	}
	g.mu.Lock()
	shut, open := g.shut, g.open
	g.mu.Unlock()
	if !shut {
		return nil
	}
	select {
	case g.waiting <- struct{}{}:
	default:
	}
	<-open
	return nil
}

// await waits until the fetcher waits at the shut gate: it has no pull
// open.
func (g *fetchGate) await(t *testing.T) {
	t.Helper()
	select {
	case <-g.waiting:
	case <-ctxFor(t, time.Minute).Done():
		t.Fatal("the runner's fetcher did not come to the gate within a minute")
	}
}

// watchedProgress reads the fence records through the lease bucket and
// calls settled, once, when a record read shows job committed: the
// runner is in the middle of a round that settles it.
type watchedProgress struct {
	b       *coordinator.Bucket
	mu      sync.Mutex
	job     uint64
	settled func()
}

func (w *watchedProgress) Committed(ctx context.Context, id leasehold.FenceID) (sink.Progress, error) {
	p, err := w.b.Committed(ctx, id)
	if err != nil {
		return p, err
	}
	w.mu.Lock()
	f := w.settled
	if f != nil && w.job != 0 && p.Includes(w.job) {
		w.settled = nil
	} else {
		f = nil
	}
	w.mu.Unlock()
	if f != nil {
		f()
	}
	return p, nil
}

func (w *watchedProgress) watch(job uint64, settled func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.job, w.settled = job, settled
}

// Job 2's first attempt fails after an effect (abort marker), its second
// completes, and the runner waits for the fence record. The messages a
// paused relay had pulled (job 1's effect) come again just as the round of
// records that shows job 2 committed is ready: job 2 applies from its
// second attempt, the first is reported aborted, and nothing is lost.
func TestRedeliveredBatchDeliversWhatTheRecordsSettle(t *testing.T) {
	t.Parallel()
	const scope = "redeliv"
	ctx := ctxFor(t, 2*time.Minute)
	pl, observer := newProofWorld(t, scope)
	progress := &watchedProgress{b: pl.bucket}
	gate := newFetchGate()
	cfg := streamsink.Config{Prefix: scope, Verifier: pl.bucket, Progress: progress, Observer: observer,
		MaxBackoff: 10 * time.Millisecond, FetchWait: time.Second, Logger: quiet(),
		// The relay's way: a job's effects in one call, a request each.
		BatchHandler: func(_ context.Context, effects []sink.Effect) error {
			pl.apply(effects...)
			return nil
		}}
	r, err := streamsink.New(ctx, pl.js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.SetHook(gate.hook)
	pl.runner = run(t, r)
	t.Cleanup(gate.release) // before the runner stops: its fetcher must not wait at the gate
	l := pl.acquire("w1")
	pl.decided(1) // the barrier

	// The paused relay: it pulled job 1's effect and never acked it.
	gate.close()
	gate.await(t)
	f1 := pl.final(l, 1, 1, 0, 0, 0)
	cons, err := pl.js.Consumer(ctx, scope+"-effects", scope+"-sink")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var held []jetstream.Msg
	for m := range batch.Messages() {
		held = append(held, m)
	}
	if len(held) != 1 {
		t.Fatalf("the paused relay pulled %d messages, want job 1's effect (%v)", len(held), batch.Error())
	}
	if meta, err := held[0].Metadata(); err != nil || meta.Sequence.Stream != f1 {
		t.Fatalf("the paused relay pulled %v (%v), want log position %d", meta, err, f1)
	}
	gate.release()

	// The relay that took over reads job 1's effect from the log, and job
	// 2's attempts as they come.
	failed := pl.effect(l, 2, 2, 0)
	pl.abort(l, 2, 2)
	f2 := pl.final(l, 2, 3, 0, 1, 1)
	pl.decided(f2)
	if got := pl.applied(); !slices.Equal(got, []string{pl.key(1, 0)}) {
		t.Fatalf("applied %v, want job 1 alone while job 2's first attempt waits for the record", got)
	}

	// The paused relay's message comes back, on the pull that follows
	// the read of the record that shows job 2 committed.
	gate.close()
	gate.await(t)
	if err := held[0].Nak(); err != nil {
		t.Fatal(err)
	}
	progress.watch(2, gate.release)
	if err := l.Commit(ctx, 2); err != nil {
		t.Fatal(err)
	}
	waitAcked(t, cons, f2)

	f3 := pl.final(l, 3, 4, 0, 2, 2)
	pl.decided(f3)
	want := []string{pl.key(1, 0), pl.key(2, 0), pl.key(3, 0)}
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Fatalf("applied %v, want %v: job 2, committed, was never handed over", got, want)
	}
	pl.outcome(failed, sink.Aborted)
	pl.outcome(f2, sink.Accepted)
	pl.outcome(f3, sink.Accepted)
}

// waitAcked waits until the runner has acked every message of the log up
// to seq, redeliveries included.
func waitAcked(t *testing.T, cons jetstream.Consumer, seq uint64) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		info, err := cons.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.AckFloor.Stream >= seq && info.NumAckPending == 0 && info.NumRedelivered == 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the runner did not ack the log up to %d within a minute: %+v", seq, info)
		case <-tick.C:
		}
	}
}
