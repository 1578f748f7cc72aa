package worker_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// batchLog records what a stream sink runner's BatchHandler was given:
// each delivery of each effect, by idempotency key.
type batchLog struct {
	mu     sync.Mutex
	by     map[string][]delivery
	calls  int
	notify chan struct{}
}

// delivery is one delivery of an effect: the epoch it was stamped with,
// its data and the handler call it came in.
type delivery struct {
	epoch leasehold.Epoch
	data  string
	call  int
}

func newBatchLog() *batchLog {
	return &batchLog{by: map[string][]delivery{}, notify: make(chan struct{}, 1)}
}

func (b *batchLog) handle(_ context.Context, effs []sink.Effect) error {
	b.mu.Lock()
	b.calls++
	for _, e := range effs {
		b.by[e.Stamp.Key] = append(b.by[e.Stamp.Key], delivery{epoch: e.Stamp.Epoch, data: string(e.Data), call: b.calls})
	}
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
	return nil
}

// wait waits until n distinct effects are applied.
func (b *batchLog) wait(t *testing.T, within time.Duration, n int) {
	t.Helper()
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	for {
		b.mu.Lock()
		got := len(b.by)
		b.mu.Unlock()
		if got >= n {
			return
		}
		select {
		case <-b.notify:
		case <-deadline.C:
			t.Fatalf("after %v, %d effects applied, want %d", within, got, n)
		}
	}
}

// check requires each of effects effects of each job in jobs (partition
// and sequence) applied, with the same data each time, nothing else, and
// a job's effects all in one call. A destination dedupes by key (I5):
// with again, an effect may come again under a later epoch, as a
// successor's re-run of a job is delivered again; never twice under one
// epoch. Without, each comes once. It returns how many came again.
func (b *batchLog) check(t *testing.T, prefix string, jobs []worker.Enqueued, effects int, again bool) int {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	bad, repeats := 0, 0
	report := func(format string, args ...any) {
		if bad++; bad <= 10 {
			t.Errorf(format, args...)
		}
	}
	for _, j := range jobs {
		first := b.by[leasehold.EffectKey(prefix, j.Partition, j.Seq, 0)]
		for i := range effects {
			k := leasehold.EffectKey(prefix, j.Partition, j.Seq, i)
			ds := b.by[k]
			switch {
			case len(ds) == 0:
				report("effect %s never applied", k)
				continue
			case len(ds) > 1 && !again:
				report("effect %s applied %d times, want once", k, len(ds))
			}
			repeats += len(ds) - 1
			epochs := map[leasehold.Epoch]bool{}
			for n, d := range ds {
				if epochs[d.epoch] {
					report("effect %s applied twice under epoch %d", k, d.epoch)
				}
				epochs[d.epoch] = true
				if d.data != ds[0].data {
					report("effect %s applied with data %q and %q", k, ds[0].data, d.data)
				}
				if n >= len(first) || first[n].call != d.call {
					report("effect %s: delivery %d in call %d, apart from the job's first effect's (%v): a job's effects apply in one call", k, n, d.call, first)
				}
			}
		}
	}
	if want := len(jobs) * effects; len(b.by) != want {
		report("%d effects applied, want %d", len(b.by), want)
	}
	return repeats
}

// emitN is a handler that emits n effects a job, data "<body>/<i>".
func emitN(n int) worker.HandlerFunc {
	return func(ctx context.Context, j *worker.Job) error {
		for i := range n {
			if err := j.Emit(ctx, fmt.Appendf(nil, "%s/%d", j.Data, i)); err != nil {
				return err
			}
		}
		return nil
	}
}

// Jobs of three effects, packed, through a stream sink runner: one log
// message a job, and every effect applied exactly once, a job's three in
// one call of the handler.
func TestPackedThroughStreamSink(t *testing.T) {
	const jobs, effects = 200, 3
	e := newEnv(t, 4)
	applied := newBatchLog()
	r := runSink(t, e, streamsink.Config{BatchHandler: applied.handle, Verifier: e.bucket})
	rec := newRecorder()
	cfg := e.packConfig("w", emitN(effects))
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, jobs)
	applied.wait(t, time.Minute, jobs*effects)
	settle(t, e, r)
	applied.check(t, e.prefix, enq, effects, false)
	if msgs := effectLog(t, e); len(msgs) != jobs {
		t.Errorf("%d messages in the effect log, want one a job, %d", len(msgs), jobs)
	}
}

// A fleet of a worker that packs and one that does not, on the same job
// stream: each runs some of the partitions, and every effect applies
// exactly once.
func TestPackedMixedFleet(t *testing.T) {
	const jobs, effects = 200, 3
	e := newEnv(t, 4)
	applied := newBatchLog()
	r := runSink(t, e, streamsink.Config{BatchHandler: applied.handle, Verifier: e.bucket})
	rec := newRecorder()
	cfgP, cfgU := e.packConfig("packing", emitN(effects)), e.config("plain", emitN(effects))
	cfgP.Observer, cfgU.Observer = rec, rec
	packing, plain := start(t, cfgP), start(t, cfgU)
	rec.waitFor(t, time.Minute, "both workers to hold partitions", func() bool {
		a, b := len(packing.w.Held()), len(plain.w.Held())
		return a > 0 && b > 0 && a+b == e.n
	})
	enq := e.enqueue(t, 0, jobs)
	applied.wait(t, time.Minute, jobs*effects)
	settle(t, e, r)
	applied.check(t, e.prefix, enq, effects, false)
	packs, alone := 0, 0
	for _, m := range effectLog(t, e) {
		if m.pack > 0 {
			packs++
		} else {
			alone++
		}
	}
	if packs == 0 || alone == 0 {
		t.Errorf("%d packed messages and %d of one effect: the fleet was not mixed", packs, alone)
	}
}

// A worker that packs loses its lease while a job holds two of its three
// effects (its process paused, as a frozen one would be), with jobs
// completed and nothing committed past them. Its successor, packing too,
// runs every job not committed again: every effect applies, each job's
// together, never twice under one epoch (a destination that dedupes by key applies each once), and the
// paused attempt's held effects never leave.
func TestPackedFailover(t *testing.T) {
	const jobs, effects = 30, 3
	e := newEnv(t, 1, natstestListen()...)
	enq := e.enqueue(t, 0, jobs)
	blockAt := enq[jobs/2].Seq
	applied := newBatchLog()
	r := runSink(t, e, streamsink.Config{BatchHandler: applied.handle, Verifier: e.bucket})

	px, _, jsA, bucketA := e.proxied(t)
	blocked, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	lateErr := make(chan error, 1)
	cfgA := e.packConfig("a", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Seq != blockAt {
			return emitN(effects)(ctx, j)
		}
		for i := range effects - 1 {
			if err := j.Emit(ctx, fmt.Appendf(nil, "%s/%d", j.Data, i)); err != nil {
				return err
			}
		}
		close(blocked)
		<-release // ignores ctx, as a paused process would
		err := j.Emit(ctx, fmt.Appendf(nil, "%s/%d", j.Data, effects-1))
		lateErr <- err
		return err
	}))
	recA := newRecorder()
	cfgA.JetStream, cfgA.Bucket, cfgA.Observer = jsA, bucketA, recA
	cfgA.Coordinator.TTL = time.Second
	cfgA.Coordinator.Margin = 100 * time.Millisecond
	cfgA.CommitEvery = time.Hour // nothing committed before the pause
	a := start(t, cfgA)
	t.Cleanup(unblock) // runs before a's stop
	select {
	case <-blocked:
	case <-time.After(time.Minute):
		t.Fatal("A never ran the job it pauses in")
	}
	recA.waitFor(t, time.Minute, "A to complete the jobs besides the paused one", func() bool {
		return recA.count(kind(worker.EventJobFinished)) == jobs-1
	})
	px.Freeze()
	recA.waitFor(t, 30*time.Second, "A to see its lease lost", func() bool { return recA.count(kind(worker.EventPartitionLost)) > 0 })

	cfgB := e.packConfig("b", emitN(effects))
	cfgB.Coordinator.TTL = time.Second
	recB := newRecorder()
	cfgB.Observer = recB
	b := start(t, cfgB)
	recB.waitCommitted(t, time.Minute, enq[jobs-1].Seq)
	applied.wait(t, time.Minute, jobs*effects)

	px.Thaw()
	unblock()
	select {
	case err := <-lateErr:
		if !strings.Contains(fmt.Sprint(err), "lease") {
			t.Errorf("A's emit after the pause: %v, want the lease lost", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("A's paused handler never returned")
	}
	a.stop(t)
	b.stop(t)
	settle(t, e, r)
	again := applied.check(t, e.prefix, enq, effects, true)
	t.Logf("%d effects delivered again, under B's epoch, of jobs A completed and B ran again", again)
	// CommitEvery is an hour, but a partition that has done every job its
	// fetcher handed over commits at once (see caughtUp): on a busy
	// machine the fetcher can hand A its first job alone, and A commits
	// it before the next arrives. Progress at or past the paused job
	// would be a defect; before it, B runs fewer jobs again.
	for _, ev := range recA.all() {
		if ev.Kind == worker.EventProgressCommitted && ev.Seq >= blockAt {
			t.Errorf("A committed progress %d, at or past the job it paused in (%d)", ev.Seq, blockAt)
		}
	}
	epochB := recB.all()[0].Lease.Epoch
	packsA := 0
	for _, m := range effectLog(t, e) {
		if m.stamp.Epoch >= epochB {
			continue
		}
		if m.pack > 0 {
			packsA++
		}
		if m.mark.Job == blockAt {
			t.Errorf("A sent %+v of the job it paused in (%d effects packed)", m.mark, m.pack)
		}
	}
	if packsA != jobs-1 {
		t.Errorf("A sent %d packed messages, want one for each job it completed, %d", packsA, jobs-1)
	}
}

// settle waits until r has decided the whole effect log.
func settle(t *testing.T, e *env, r *streamsink.Runner) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	s, err := e.js.Stream(ctx, worker.EffectsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.WaitPosition(ctx, info.State.LastSeq); err != nil {
		t.Fatal(err)
	}
}
