package worker_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// The zombie path. Worker A's handler blocks on a job while A is cut off
// from NATS past its lease TTL, as a paused process would be. B takes the
// partition over with a higher epoch and handles it. Then A comes back and
// its handler carries on: its emit is refused locally with ErrLeaseLost, a
// write stamped earlier lands with A's old epoch behind B's barrier (where
// an in-order sink refuses it), and A's progress commit is refused by the
// server. B handles every job A did not finish; nothing is lost.
func TestZombieCannotSkipWork(t *testing.T) {
	e := newEnv(t, 1, natstestListen()...)
	const p = leasehold.Partition(0)
	enq := e.enqueue(t, 0, 10)
	blockAt := enq[4].Seq

	px, _, jsA, bucketA := e.proxied(t)

	var (
		blocked  = make(chan struct{})
		release  = make(chan struct{})
		mu       sync.Mutex
		zombie   struct{ ctxErr, emitErr, rawErr error }
		runsB    runLog
		recA     = newRecorder()
		recB     = newRecorder()
		stampOld leasehold.Stamp
	)
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	cfgA := e.config("a", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if err := j.Emit(ctx, j.Data); err != nil {
			return err
		}
		if j.Seq != blockAt {
			return nil
		}
		// A write of its own, stamped before the pause.
		s, err := j.NextStamp()
		if err != nil {
			return err
		}
		mu.Lock()
		stampOld = s
		mu.Unlock()
		close(blocked)
		<-release // ignores ctx, as a paused process would
		mu.Lock()
		defer mu.Unlock()
		zombie.ctxErr = context.Cause(ctx)
		zombie.emitErr = j.Emit(ctx, []byte("late"))
		msg := &nats.Msg{Subject: worker.OutputSubject(e.prefix, p), Data: []byte("zombie"), Header: nats.Header{}}
		s.SetHeader(msg.Header)
		_, zombie.rawErr = jsA.PublishMsg(ctxFor(t, 10*time.Second), msg, jetstream.WithMsgID(s.Key))
		return nil
	}))
	cfgA.JetStream, cfgA.Bucket = jsA, bucketA
	cfgA.Coordinator.TTL = time.Second
	cfgA.Coordinator.Margin = 100 * time.Millisecond
	cfgA.CommitEvery = time.Hour // nothing committed before the pause
	cfgA.Observer = recA
	a := start(t, cfgA)
	t.Cleanup(unblock) // runs before a's stop

	select {
	case <-blocked:
	case <-time.After(30 * time.Second):
		t.Fatal("A never reached the blocking job")
	}
	px.Freeze()
	recA.waitFor(t, 30*time.Second, "A to see its lease lost", func() bool { return recA.count(kind(worker.EventPartitionLost)) > 0 })

	cfgB := e.config("b", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runsB.add(j)
		return j.Emit(ctx, j.Data)
	}))
	cfgB.Coordinator.TTL = time.Second
	cfgB.Observer = recB
	b := start(t, cfgB)
	enq = append(enq, e.enqueue(t, 10, 5)...)
	recB.waitFor(t, 30*time.Second, "B to handle every job", func() bool { return runsB.n.Load() >= int64(len(enq)) })

	px.Thaw()
	unblock()
	refused := func(ev worker.Event) bool {
		return ev.Kind == worker.EventCommitFailed && errors.Is(ev.Err, leasehold.ErrLeaseLost)
	}
	recA.waitFor(t, 30*time.Second, "A's commit to be refused", func() bool { return recA.count(refused) > 0 })
	a.stop(t)
	b.stop(t)

	epochA, epochB := recA.all()[0].Lease.Epoch, recB.all()[0].Lease.Epoch
	if epochB <= epochA {
		t.Fatalf("B took over at epoch %d, not above A's %d", epochB, epochA)
	}
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(zombie.ctxErr, leasehold.ErrLeaseLost) {
		t.Errorf("A's handler context: cause %v, want one matching ErrLeaseLost", zombie.ctxErr)
	}
	if !errors.Is(zombie.emitErr, leasehold.ErrLeaseLost) {
		t.Errorf("A's late emit: %v, want an error matching ErrLeaseLost", zombie.emitErr)
	}
	if zombie.rawErr != nil {
		t.Fatalf("A's raw write: %v", zombie.rawErr)
	}
	for _, ev := range recA.all() {
		if ev.Kind == worker.EventProgressCommitted {
			t.Errorf("A committed progress %d", ev.Seq)
		}
	}
	fenced, err := e.bucket.FencedEpoch(ctxFor(t, 10*time.Second), p)
	if err != nil || fenced != epochB {
		t.Fatalf("progress fenced at %d (%v), want B's epoch %d", fenced, err, epochB)
	}

	// B ran every job from the blocked one on, under its epoch.
	ranB := map[uint64]bool{}
	for _, r := range runsB.all() {
		if r.Epoch != epochB {
			t.Fatalf("B ran job %d under epoch %d", r.Seq, r.Epoch)
		}
		ranB[r.Seq] = true
	}
	for _, q := range enq {
		if q.Seq >= blockAt && !ranB[q.Seq] {
			t.Errorf("B never ran job %d, which A did not finish", q.Seq)
		}
	}

	// The log: read it as an in-order sink would, raising the fence at
	// every barrier. A's late write is refused, and so is every other
	// effect of A's that reached the log behind B's barrier (its message ID
	// carries A's epoch, so the stream keeps it for the sink to refuse
	// rather than dropping B's re-run as its duplicate); nothing of B's is
	// refused, and every job has an accepted effect.
	var fence leasehold.FenceState
	accepted := map[uint64]bool{}
	var refusedKeys []string
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		s := stampOf(t, m)
		v, raise := leasehold.Judge(fence, s)
		if v != leasehold.Admit {
			refusedKeys = append(refusedKeys, s.Key)
			if s.Epoch != epochA {
				t.Errorf("refused %s of epoch %d, not A's", s.Key, s.Epoch)
			}
			continue
		}
		if raise {
			fence = leasehold.FenceState{Epoch: s.Epoch, Acquisition: s.Acquisition}
		}
		if !isBarrier(m) {
			accepted[seqOfKey(t, e.prefix, s)] = true
		}
	}
	if !slices.Contains(refusedKeys, stampOld.Key) {
		t.Errorf("an in-order sink refuses %v; want A's late write %s among them", refusedKeys, stampOld.Key)
	}
	for _, q := range enq {
		if !accepted[q.Seq] {
			t.Errorf("job %d has no accepted effect", q.Seq)
		}
	}
}
