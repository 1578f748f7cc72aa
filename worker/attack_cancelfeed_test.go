package worker_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Attacks on the worker's one watch of cancels (cancelFeed): a runner
// that starts takes its partition's stored cancels from the watch once
// the watch has come up to the bucket's last sequence. Each test checks
// the contract of cancels: a cancel stored before a partition's runner
// starts skips its job, and a later one reaches the running job.

// feedHandler runs jobs by their data: "hold" blocks until its context
// ends (and says so on held), "block" does too and reports its cause on
// causes, anything else returns at once. ran counts the runs of each
// datum.
type feedHandler struct {
	mu     sync.Mutex
	ran    map[string]int
	held   chan leasehold.Partition
	causes chan error
	// holdAll: "hold" blocks on this worker; on another, it returns.
	holdAll bool
}

func newFeedHandler(hold bool) *feedHandler {
	return &feedHandler{ran: map[string]int{}, held: make(chan leasehold.Partition, 16), causes: make(chan error, 16), holdAll: hold}
}

func (h *feedHandler) runs(data string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ran[data]
}

func (h *feedHandler) Handle(ctx context.Context, job *worker.Job) error {
	d := string(job.Data)
	h.mu.Lock()
	h.ran[d]++
	h.mu.Unlock()
	switch {
	case d == "hold" && h.holdAll:
		h.held <- job.Partition
		<-ctx.Done()
		return context.Cause(ctx)
	case d == "block":
		<-ctx.Done()
		h.causes <- context.Cause(ctx)
		return context.Cause(ctx)
	}
	return job.Emit(ctx, []byte("effect of "+d))
}

func readyOn(rec *recorder, p leasehold.Partition) func() bool {
	return func() bool {
		return rec.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventPartitionReady && ev.Lease.Partition == p
		}) > 0
	}
}

// putCancelKey stores val at key in the bucket of cancels, as a producer
// or anyone allowed to write the bucket would.
func putCancelKey(t *testing.T, ctx context.Context, e *env, key string, val []byte) uint64 {
	t.Helper()
	kv, err := e.js.KeyValue(ctx, worker.CancelBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Put(ctx, key, val)
	if err != nil {
		t.Fatal(err)
	}
	return rev
}

// handOff runs w1 on both partitions of a two-partition env (its watch of
// cancels started and caught up), then w2 until it holds one of them, P.
// It returns both workers, P, and their handlers: w2's blocks on "hold".
func handOff(t *testing.T, e *env, tweak1 ...func(*worker.Config)) (w1, w2 *running, p leasehold.Partition, h1, h2 *feedHandler, rec1 *recorder) {
	t.Helper()
	h1, h2 = newFeedHandler(false), newFeedHandler(true)
	rec1, rec2 := newRecorder(), newRecorder()
	cfg1 := e.config("w1", h1)
	for _, f := range tweak1 {
		f(&cfg1)
	}
	cfg1.Observer = rec1
	cfg1.PartitionConcurrency = 1
	w1 = start(t, cfg1)
	rec1.waitFor(t, 30*time.Second, "w1 to run both partitions", func() bool { return readyOn(rec1, 0)() && readyOn(rec1, 1)() })

	cfg2 := e.config("w2", h2)
	cfg2.Observer = rec2
	cfg2.PartitionConcurrency = 1
	cfg2.Coordinator.ShutdownTimeout = 500 * time.Millisecond
	w2 = start(t, cfg2)
	rec2.waitFor(t, 30*time.Second, "w2 to take a partition", func() bool { return readyOn(rec2, 0)() || readyOn(rec2, 1)() })
	if readyOn(rec2, 1)() {
		p = 1
	}
	return w1, w2, p, h1, h2, rec1
}

// holdThenVictim enqueues "hold" and "victim" to partition p, one after
// the other, waits until h's worker runs "hold", and returns the victim,
// queued behind it.
func holdThenVictim(t *testing.T, ctx context.Context, prod *worker.Producer, p leasehold.Partition, h *feedHandler) worker.Enqueued {
	t.Helper()
	if _, err := prod.EnqueueTo(ctx, p, []byte("hold")); err != nil {
		t.Fatal(err)
	}
	victim, err := prod.EnqueueTo(ctx, p, []byte("victim"))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.held:
	case <-ctx.Done():
		t.Fatal("the worker never ran the job")
	}
	return victim
}

// cancelHeldThenFailOver enqueues two jobs to w2's partition (one at a
// time there): "hold", which w2 runs until it stops, and "victim" behind
// it. It cancels the victim while w2 holds the partition and stops w2.
// w1, whose watch of cancels runs, takes the partition and must skip the
// victim: its cancel was stored before w1's runner started.
func cancelHeldThenFailOver(t *testing.T, ctx context.Context, e *env, w2 *running, p leasehold.Partition, h1, h2 *feedHandler, rec1 *recorder) {
	t.Helper()
	prod := e.statusProducer(t)
	j := holdThenVictim(t, ctx, prod, p, h2)
	st, err := prod.Cancel(ctx, j)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cancelled job %s while it was %s", j.Ref(), st.State)
	w2.stop(t)
	rec1.waitFor(t, 30*time.Second, "w1 to take w2's partition", func() bool {
		return rec1.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventPartitionReady && ev.Lease.Partition == p
		}) > 1
	})
	sts, err := prod.Wait(ctx, j)
	if err != nil {
		t.Fatal(err)
	}
	if sts[0].State != worker.JobCancelled || h1.runs("victim") != 0 || h2.runs("victim") != 0 {
		t.Fatalf("job %s, cancelled before w1 took its partition, ran %d times on w1 and %d on w2; Status says %q (%s); want it skipped and cancelled",
			j.Ref(), h1.runs("victim"), h2.runs("victim"), sts[0].State, sts[0].Detail)
	}
}

// A cancel stored just before a partition moves to a worker whose watch
// of cancels already runs (a fail-over from another worker) is seen by
// that worker's new runner before it runs the job.
func TestAttackCancelFeedFailOverToRunningFeed(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 90*time.Second)
	_, w2, p, h1, h2, rec1 := handOff(t, e)
	cancelHeldThenFailOver(t, ctx, e, w2, p, h1, h2, rec1)
}

// The bucket of cancels deleted and made again (an operator starting
// over with `leasehold init`, a restore) numbers its records from 1
// again. A worker whose watch ran on the old bucket has delivered
// revisions beyond the new bucket's last: a runner that starts must not
// take that for "caught up" and run a job whose cancel the new bucket
// holds. It fails if the cancel, stored in the new bucket before the
// runner started, is not seen (the job runs and is done).
func TestAttackCancelFeedBucketRecreated(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 90*time.Second)
	// Records of a partition nobody holds: the old bucket's revisions
	// run past what the new one will hold.
	for i := range 5 {
		putCancelKey(t, ctx, e, fmt.Sprintf("7.s%d", 1000+i), []byte(`{}`))
	}
	_, w2, p, h1, h2, rec1 := handOff(t, e)

	if err := e.js.DeleteKeyValue(ctx, worker.CancelBucket(e.prefix)); err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: e.n, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	cancelHeldThenFailOver(t, ctx, e, w2, p, h1, h2, rec1)
}

// The connection of the worker that takes the partition drops with its
// question for the bucket's last sequence on it (the one a starting
// runner asks, shared by the runners starting with it): no answer ever
// comes. The try must give up on it, and the runner start again and still
// see the cancel stored before it started.
func TestAttackCancelFeedConnectionCutAtLastSeq(t *testing.T) {
	e := newEnv(t, 2, natstestListen()...)
	ctx := ctxFor(t, 90*time.Second)
	px, _, js1, bucket1 := e.proxied(t)
	_, w2, p, h1, h2, rec1 := handOff(t, e, func(c *worker.Config) { c.JetStream, c.Bucket = js1, bucket1 })
	cut := px.CutAt("$JS.API.STREAM.INFO.KV_" + worker.CancelBucket(e.prefix))
	cancelHeldThenFailOver(t, ctx, e, w2, p, h1, h2, rec1)
	select {
	case <-cut:
	default:
		t.Fatal("the cut never happened: the runner did not ask for the bucket's last sequence")
	}
}

// cancelStoredThenStart stores a job on partition 0 and its cancel, and a
// job on partition 1, then lets mutate change the bucket before a worker
// starts. The cancelled job must be skipped, the other done, and a cancel
// of a job running afterwards must reach it, each within the test's time.
func cancelStoredThenStart(t *testing.T, n int, mutate func(ctx context.Context, e *env)) {
	e := newEnv(t, n)
	ctx := ctxFor(t, 60*time.Second)
	prod := e.statusProducer(t)
	j, err := prod.EnqueueTo(ctx, 0, []byte("cancelled"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Cancel(ctx, j); err != nil {
		t.Fatal(err)
	}
	k, err := prod.EnqueueTo(ctx, 1, []byte("kept"))
	if err != nil {
		t.Fatal(err)
	}
	mutate(ctx, e)
	h := newFeedHandler(false)
	began := time.Now()
	start(t, e.config("w1", h))
	sts, err := prod.Wait(ctx, j, k)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("both stored jobs settled %v after the worker started", time.Since(began))
	if sts[0].State != worker.JobCancelled || h.runs("cancelled") != 0 {
		t.Fatalf("job %s, cancelled before the worker started, ran %d times; Status says %q (%s)", j.Ref(), h.runs("cancelled"), sts[0].State, sts[0].Detail)
	}
	if sts[1].State != worker.JobDone {
		t.Fatalf("job %s: %q (%s), want done", k.Ref(), sts[1].State, sts[1].Detail)
	}
	// A later cancel reaches a running job.
	l, err := prod.EnqueueTo(ctx, 1, []byte("block"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Cancel(ctx, l); err != nil {
		t.Fatal(err)
	}
	select {
	case cause := <-h.causes:
		if !errors.Is(cause, worker.ErrJobCancelled) {
			t.Fatalf("the running job's context ended with %v, want ErrJobCancelled", cause)
		}
	case <-ctx.Done():
		t.Fatal("a cancel of a running job never reached it")
	}
	if sts, err := prod.Wait(ctx, l); err != nil || sts[0].State != worker.JobCancelled {
		t.Fatalf("the running job's cancel: %+v, %v", sts, err)
	}
}

// The bucket's last message removed from its stream (a purge of its
// subject, by an operator; the stream denies DeleteMsg) is never delivered by any watch: the worker's watch
// never comes up to the last sequence the server reports. The runners
// must still start within a bounded time and see the stored cancels.
func TestAttackCancelFeedLastMessageDeleted(t *testing.T) {
	cancelStoredThenStart(t, 4, func(ctx context.Context, e *env) {
		rev := putCancelKey(t, ctx, e, "junk", []byte("x"))
		s, err := e.js.Stream(ctx, "KV_"+worker.CancelBucket(e.prefix))
		if err != nil {
			t.Fatal(err)
		}
		// A KV stream denies DeleteMsg; a purge of the subject removes the
		// message the same way, with no marker for a watch to deliver.
		if err := s.Purge(ctx, jetstream.WithPurgeSubject("$KV."+worker.CancelBucket(e.prefix)+".junk")); err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.LastSeq != rev {
			t.Fatalf("the stream's last sequence is %d after deleting %d: the attack needs it kept", info.State.LastSeq, rev)
		}
	})
}

// Anyone allowed to write the bucket can store any key: keys that name no
// partition, partitions far beyond the worker's, numbers that overflow,
// keys with an empty part, garbage values, and many of them. None may
// crash the worker, stall its partitions, or hide a real cancel.
func TestAttackCancelFeedForgedKeys(t *testing.T) {
	cancelStoredThenStart(t, 2, func(ctx context.Context, e *env) {
		for _, k := range []string{
			"junk", "a.b", "0", "1", "00.s1", "000001.s999999", "-1.s1",
			"4294967295.s1", "4294967296.s1", "18446744073709551616.s1",
			"99999999999999999999999999999999.s1", "0.s999999", "1.s999998", "1.i", "0.ideadbeef",
			"0.s999997.extra", "1.x.y.z",
		} {
			putCancelKey(t, ctx, e, k, []byte("{{{ not json"))
		}
		putCancelKey(t, ctx, e, "0.s999996", []byte(`{"ref":"x","partition":1,"seq":5}`))
		kv, err := e.js.KeyValue(ctx, worker.CancelBucket(e.prefix))
		if err != nil {
			t.Fatal(err)
		}
		for i := range 500 {
			if _, err := kv.Put(ctx, fmt.Sprintf("4294967295.s%d", i), []byte(`{"ref":"forged"}`)); err != nil {
				t.Fatal(err)
			}
		}
		// Deleted and purged keys among them.
		if err := kv.Delete(ctx, "junk"); err != nil {
			t.Fatal(err)
		}
		if err := kv.Purge(ctx, "4294967295.s0"); err != nil {
			t.Fatal(err)
		}
	})
}

// A stream purge of the bucket (not of a key) before the worker starts,
// then a cancel stored after it: the purge leaves no record to watch.
func TestAttackCancelFeedPurgedBeforeStart(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	prod := e.statusProducer(t)
	old, err := prod.EnqueueTo(ctx, 0, []byte("old"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Cancel(ctx, old); err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, "KV_"+worker.CancelBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	j, err := prod.EnqueueTo(ctx, 1, []byte("cancelled"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Cancel(ctx, j); err != nil {
		t.Fatal(err)
	}
	h := newFeedHandler(false)
	start(t, e.config("w1", h))
	sts, err := prod.Wait(ctx, old, j)
	if err != nil {
		t.Fatal(err)
	}
	if sts[0].State != worker.JobDone || h.runs("old") != 1 {
		t.Fatalf("job %s, whose cancel was purged before the worker started: %q (%s), ran %d times", old.Ref(), sts[0].State, sts[0].Detail, h.runs("old"))
	}
	if sts[1].State != worker.JobCancelled || h.runs("cancelled") != 0 {
		t.Fatalf("job %s, cancelled after the purge: %q (%s), ran %d times", j.Ref(), sts[1].State, sts[1].Detail, h.runs("cancelled"))
	}
}

// Many runners start together on a cold worker, with cancels stored in a
// quarter of the partitions: every cancelled job is skipped and every
// other is done. The test counts the questions for the bucket's stream
// (STREAM.INFO) and the consumers made on it, which the change is to
// keep to a few, and logs them.
func TestAttackCancelFeedManyRunnersStartTogether(t *testing.T) {
	const n = 32
	e := newEnv(t, n)
	ctx := ctxFor(t, 90*time.Second)
	stream := "KV_" + worker.CancelBucket(e.prefix)
	nc := e.srv.Connect(t)
	var infos, creates atomic.Int64
	for subj, c := range map[string]*atomic.Int64{
		"$JS.API.STREAM.INFO." + stream:            &infos,
		"$JS.API.CONSUMER.CREATE." + stream:        &creates,
		"$JS.API.CONSUMER.CREATE." + stream + ".>": &creates,
	} {
		sub, err := nc.Subscribe(subj, func(*nats.Msg) { c.Add(1) })
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	prod := e.statusProducer(t)
	jobs := make([]worker.Enqueued, n)
	for i := range jobs {
		var err error
		if jobs[i], err = prod.EnqueueTo(ctx, leasehold.Partition(i), []byte(fmt.Sprintf("job-%d", i))); err != nil {
			t.Fatal(err)
		}
		if i%4 == 0 {
			if _, err := prod.Cancel(ctx, jobs[i]); err != nil {
				t.Fatal(err)
			}
		}
	}
	infosBefore, createsBefore := infos.Load(), creates.Load()
	h := newFeedHandler(false)
	w := start(t, e.config("w1", h))
	sts, err := prod.Wait(ctx, jobs...)
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range sts {
		want := worker.JobDone
		if i%4 == 0 {
			want = worker.JobCancelled
		}
		if st.State != want || (want == worker.JobCancelled) != (h.runs(fmt.Sprintf("job-%d", i)) == 0) {
			t.Errorf("partition %d's job: %q (%s), ran %d times; want %q", i, st.State, st.Detail, h.runs(fmt.Sprintf("job-%d", i)), want)
		}
	}
	w.stop(t)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d runners started: %d STREAM.INFO of the bucket of cancels by worker and producer, %d consumers made on it",
		n, infos.Load()-infosBefore, creates.Load()-createsBefore)
}

// A cancel removed from the bucket's stream without a marker (a purge of
// its subject by an operator: no watch sees it) after the worker's watch
// delivered it. A runner that starts afterwards reads what is stored: the
// job, whose cancel no longer exists, runs. It fails if the runner takes
// the removed record from what the watch kept and skips the job.
func TestAttackCancelFeedSubjectPurgedAfterDelivered(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 90*time.Second)
	putCancelKey(t, ctx, e, "7.s1000", []byte(`{}`)) // keeps the stream's first below the cancel's
	_, w2, p, h1, h2, rec1 := handOff(t, e)
	q := 1 - p
	prod := e.statusProducer(t)
	victim := holdThenVictim(t, ctx, prod, p, h2)
	if _, err := prod.Cancel(ctx, victim); err != nil {
		t.Fatal(err)
	}
	// A cancel of a job running on w1, stored after the victim's: once it
	// reaches the job, w1's watch has delivered the victim's too.
	blocked, err := prod.EnqueueTo(ctx, q, []byte("block"))
	if err != nil {
		t.Fatal(err)
	}
	rec1.waitFor(t, 30*time.Second, "w1 to run the blocking job", func() bool {
		return rec1.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobStarted && ev.Seq == blocked.Seq }) > 0
	})
	if _, err := prod.Cancel(ctx, blocked); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h1.causes:
	case <-ctx.Done():
		t.Fatal("the cancel of w1's running job never reached it")
	}
	s, err := e.js.Stream(ctx, "KV_"+worker.CancelBucket(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	subj := fmt.Sprintf("$KV.%s.%d.s%d", worker.CancelBucket(e.prefix), p, victim.Seq)
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(subj)); err != nil {
		t.Fatal(err)
	}
	w2.stop(t)
	sts, err := prod.Wait(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	if h1.runs("victim") != 1 {
		t.Fatalf("job %s, whose cancel was removed before w1 took its partition, ran %d times on w1; Status says %q (%s)",
			victim.Ref(), h1.runs("victim"), sts[0].State, sts[0].Detail)
	}
}
