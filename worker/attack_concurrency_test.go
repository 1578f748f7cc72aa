package worker_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// Attacks on a partition that runs several jobs at once, from outside the
// worker: a zombie with many jobs in flight whose writes reach the log
// after its successor's barrier, and a job that hangs while later jobs of its
// partition complete around it (the partition moves with jobs finished out
// of order). A
// stream sink runner that verifies epochs and reads committed progress
// applies the log to a destination that dedupes by key, as `leasehold
// sink` does; the checks are those the project promises: no committed job
// lost, none applied twice, no stale write applied.

// dedupeDest is a destination that dedupes by idempotency key: the first
// value of a key is kept, and later deliveries of it are counted.
type dedupeDest struct {
	mu     sync.Mutex
	first  map[string]string
	again  map[string]int
	notify chan struct{}
}

func newDedupeDest() *dedupeDest {
	return &dedupeDest{first: map[string]string{}, again: map[string]int{}, notify: make(chan struct{}, 1)}
}

func (d *dedupeDest) handle(_ context.Context, e sink.Effect) error {
	d.mu.Lock()
	if _, ok := d.first[e.Stamp.Key]; ok {
		d.again[e.Stamp.Key]++
	} else {
		d.first[e.Stamp.Key] = string(e.Data)
	}
	d.mu.Unlock()
	select {
	case d.notify <- struct{}{}:
	default:
	}
	return nil
}

func (d *dedupeDest) get(key string) (string, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.first[key]
	return v, ok
}

// waitKeys waits until every key is applied, within d.
func (d *dedupeDest) waitKeys(t *testing.T, within time.Duration, keys []string, what string) {
	t.Helper()
	ctx := ctxFor(t, within)
	for {
		var missing []string
		for _, k := range keys {
			if _, ok := d.get(k); !ok {
				missing = append(missing, k)
			}
		}
		if len(missing) == 0 {
			return
		}
		select {
		case <-d.notify:
		case <-ctx.Done():
			t.Fatalf("LOST: %s: %d keys never applied: %v", what, len(missing), missing)
		}
	}
}

// verifyingSink runs a stream sink runner on e's effect log with the
// lease bucket as Verifier (and so progress reader), as `leasehold sink`
// does, and a decision observer.
func verifyingSink(t *testing.T, e *env, h func(context.Context, sink.Effect) error, obs sink.Observer) *streamsink.Runner {
	t.Helper()
	return runSink(t, e, streamsink.Config{Handler: h, Verifier: e.bucket, Observer: obs})
}

// staleSeen records the effects the runner refused as stale or split
// brain, and any it applied from an epoch below one it had admitted.
type staleSeen struct {
	mu      sync.Mutex
	max     map[leasehold.FenceID]leasehold.Epoch
	refused []sink.Decision
	bad     []string
}

func newStaleSeen() *staleSeen { return &staleSeen{max: map[leasehold.FenceID]leasehold.Epoch{}} }

func (s *staleSeen) Decided(_ context.Context, d sink.Decision) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := d.Stamp.Fence()
	switch d.Outcome {
	case sink.Stale, sink.SplitBrain:
		s.refused = append(s.refused, d)
	case sink.Advanced:
		s.max[id] = max(s.max[id], d.Stamp.Epoch)
	case sink.Accepted:
		if d.Stamp.Epoch < s.max[id] {
			s.bad = append(s.bad, fmt.Sprintf("%s of epoch %d at log position %d applied after epoch %d was admitted", d.Stamp.Key, d.Stamp.Epoch, d.Position, s.max[id]))
		}
	}
}

func (s *staleSeen) refusedOf(e leasehold.Epoch) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, d := range s.refused {
		if d.Stamp.Epoch == e {
			n++
		}
	}
	return n
}

// waitSinkAt waits until the runner has decided the whole effect log.
func waitSinkAt(t *testing.T, e *env, r *streamsink.Runner) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
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

// A worker runs eight jobs of one partition at once (eight keys); each has
// put its first effect in the log and holds its second (the job's final)
// when the worker is cut off, as a paused process would be. The handlers
// return while it is cut off, so that its finals wait in the network to
// reach the log behind its successor's barrier. The successor runs the
// eight jobs again. When the zombie comes back, every one of its late
// finals is refused, and every job applies once, from the successor.
func TestAttackZombieWithManyJobsInFlight(t *testing.T) {
	e := newEnv(t, 1, natstestListen()...)
	dest := newDedupeDest()
	seen := newStaleSeen()
	r := verifyingSink(t, e, dest.handle, seen)

	px, ncA, jsA, bucketA := e.proxied(t)

	const n = 8
	paused := make(chan uint64, n)
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	handler := func(name string, block bool) worker.HandlerFunc {
		return func(ctx context.Context, j *worker.Job) error {
			for i := range 2 {
				if err := j.Emit(ctx, []byte(fmt.Sprintf("%s job %d effect %d", name, j.Seq, i))); err != nil {
					return err
				}
			}
			if block {
				paused <- j.Seq
				<-release // ignores ctx, as a paused process would
			}
			return nil
		}
	}
	recA, recB := newRecorder(), newRecorder()
	cfgA := e.config("a", handler("a", true))
	cfgA.JetStream, cfgA.Bucket, cfgA.Observer = jsA, bucketA, recA
	cfgA.PartitionConcurrency = n
	cfgA.CommitEvery = time.Hour
	a := start(t, cfgA)

	enq := e.enqueue(t, 0, n)
	seqs := map[uint64]bool{}
	for _, q := range enq {
		seqs[q.Seq] = true
	}
	ctx := ctxFor(t, 30*time.Second)
	for range n {
		select {
		case s := <-paused:
			if !seqs[s] {
				t.Fatalf("job %d paused; it is not one of the jobs enqueued", s)
			}
		case <-ctx.Done():
			t.Fatal("the worker did not run the jobs side by side")
		}
	}
	// Every job's first effect is in the log: the runner holds eight open
	// groups of A's lease.
	firstKeys := make([]string, 0, n)
	for _, q := range enq {
		firstKeys = append(firstKeys, leasehold.EffectKey(e.prefix, 0, q.Seq, 0))
	}
	for {
		found := 0
		for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
			for _, k := range firstKeys {
				if keyOf(m.Headers()) == k {
					found++
				}
			}
		}
		if found == n {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d of %d first effects in the log", found, n)
		case <-time.After(10 * time.Millisecond):
		}
	}
	epochA := recA.all()[0].Lease.Epoch
	px.Freeze()
	unblock()
	// The finals are sent, and held in the network.
	recA.waitFor(t, 10*time.Second, "A's handlers to return", func() bool {
		return recA.count(kind(worker.EventJobFinished)) >= n
	})
	for px.HoldingSent() == 0 {
		select {
		case <-ctx.Done():
			t.Fatal("nothing A sent is held")
		case <-time.After(5 * time.Millisecond):
		}
	}

	cfgB := e.config("b", handler("b", false))
	cfgB.Observer = recB
	cfgB.PartitionConcurrency = n
	b := start(t, cfgB)
	var keys []string
	for _, q := range enq {
		keys = append(keys, leasehold.EffectKey(e.prefix, 0, q.Seq, 0), leasehold.EffectKey(e.prefix, 0, q.Seq, 1))
	}
	dest.waitKeys(t, 15*time.Second, keys, "the successor's run of the zombie's jobs")
	px.Thaw()
	recA.waitFor(t, 15*time.Second, "A to see its lease lost", func() bool { return recA.count(kind(worker.EventPartitionLost)) > 0 })
	// What the zombie sent while cut off reaches the server before the
	// answer to a ping sent after it; then the runner decides it all.
	if err := ncA.FlushTimeout(15 * time.Second); err != nil {
		t.Fatalf("the zombie's connection did not flush: %v", err)
	}
	waitSinkAt(t, e, r)
	t.Logf("the runner refused %d late writes of the zombie's epoch %d", seen.refusedOf(epochA), epochA)
	a.stop(t)
	b.stop(t)

	seen.mu.Lock()
	for _, s := range seen.bad {
		t.Errorf("STALE APPLIED: %s", s)
	}
	seen.mu.Unlock()
	for _, q := range enq {
		for i := range 2 {
			key := leasehold.EffectKey(e.prefix, 0, q.Seq, i)
			want := fmt.Sprintf("b job %d effect %d", q.Seq, i)
			if got, _ := dest.get(key); got != want {
				t.Errorf("job %d effect %d: applied %q, want the successor's %q (the zombie's attempt never completed in its lease)", q.Seq, i, got, want)
			}
		}
	}
	dest.mu.Lock()
	defer dest.mu.Unlock()
	for k, c := range dest.again {
		t.Errorf("key %s delivered %d more times after it was applied", k, c)
	}
}

// The first job of a partition hangs (it ignores its context) while the
// jobs of other keys behind it complete, out of stream order. The hang
// releases the partition, with the jobs beyond the watermark committed as
// done; another worker takes it, runs the hung job and skips the others.
// The hung handler then returns, and its final reaches the log late. Every
// job applies once: the hung one from the run that completed, the others
// from their first run.
func TestAttackHungJobThenMoveWithJobsDoneOutOfOrder(t *testing.T) {
	e := newEnv(t, 1)
	dest := newDedupeDest()
	seen := newStaleSeen()
	r := verifyingSink(t, e, dest.handle, seen)

	hung := make(chan struct{})
	release := make(chan struct{})
	var relOnce sync.Once
	unhang := func() { relOnce.Do(func() { close(release) }) }
	t.Cleanup(unhang)
	var hangOnce sync.Once
	var mu sync.Mutex
	ran := map[uint64][]string{}
	var hungData string // effect 0 of the attempt that hung
	handler := func(name string) worker.HandlerFunc {
		return func(ctx context.Context, j *worker.Job) error {
			mu.Lock()
			ran[j.Seq] = append(ran[j.Seq], name)
			mu.Unlock()
			if err := j.Emit(ctx, []byte(fmt.Sprintf("%s job %d attempt %d effect 0", name, j.Seq, j.Attempt))); err != nil {
				return err
			}
			if string(j.Data) != "key-0" || name != "a" {
				return nil
			}
			first := false
			hangOnce.Do(func() { first = true })
			if !first {
				return nil
			}
			if err := j.Emit(ctx, []byte(fmt.Sprintf("%s job %d attempt %d effect 1", name, j.Seq, j.Attempt))); err != nil {
				return err
			}
			mu.Lock()
			hungData = fmt.Sprintf("%s job %d attempt %d effect 0", name, j.Seq, j.Attempt)
			mu.Unlock()
			close(hung)
			<-release // ignores ctx
			return nil
		}
	}
	recA, recB := newRecorder(), newRecorder()
	cfgA := e.config("a", handler("a"))
	cfgA.Observer = recA
	cfgA.PartitionConcurrency = 8
	cfgA.HandleTimeout = 2 * time.Second
	cfgA.HangGrace = 200 * time.Millisecond
	start(t, cfgA)
	enq := e.enqueue(t, 0, 6)
	select {
	case <-hung:
	case <-time.After(10 * time.Second):
		t.Fatal("the first job never ran")
	}
	// The five jobs behind the hung one complete and are committed as done
	// beyond the watermark.
	recA.waitFor(t, 10*time.Second, "the jobs behind the hung one committed as done", func() bool {
		return recA.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventProgressCommitted && len(ev.Done) == len(enq)-1
		}) > 0
	})
	cfgB := e.config("b", handler("b"))
	cfgB.Observer = recB
	cfgB.PartitionConcurrency = 8
	start(t, cfgB)
	recA.waitFor(t, 15*time.Second, "the hung job reported", func() bool { return recA.count(kind(worker.EventJobHung)) > 0 })
	key0 := leasehold.EffectKey(e.prefix, 0, enq[0].Seq, 0)
	key1 := leasehold.EffectKey(e.prefix, 0, enq[0].Seq, 1)
	var keys []string
	for _, q := range enq {
		keys = append(keys, leasehold.EffectKey(e.prefix, 0, q.Seq, 0))
	}
	dest.waitKeys(t, 15*time.Second, keys, "jobs around a hung one")
	unhang()
	waitSinkAt(t, e, r)

	seen.mu.Lock()
	for _, s := range seen.bad {
		t.Errorf("STALE APPLIED: %s", s)
	}
	seen.mu.Unlock()
	if v, ok := dest.get(key1); ok {
		t.Errorf("the hung attempt's effect 1 was applied (%q): its attempt never completed", v)
	}
	mu.Lock()
	hungV := hungData
	mu.Unlock()
	if v, _ := dest.get(key0); v == hungV || v == "" {
		t.Errorf("the hung job's effect 0 is %q: the hung attempt's (%q) never completed, and a later run's is due", v, hungV)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, q := range enq[1:] {
		if got := ran[q.Seq]; len(got) != 1 {
			t.Errorf("job %d, committed as done beyond the watermark, ran %v: a successor skips it", q.Seq, got)
		}
	}
	if got := ran[enq[0].Seq]; len(got) < 2 {
		t.Errorf("the hung job ran %v, want again after the hang", got)
	}
	dest.mu.Lock()
	defer dest.mu.Unlock()
	for k, c := range dest.again {
		t.Errorf("key %s delivered %d more times after it was applied", k, c)
	}
}
