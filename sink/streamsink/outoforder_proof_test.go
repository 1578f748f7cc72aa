package streamsink_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// proofLog is a job stream of one partition whose leases the test takes
// through a coordinator, as workers do, and whose effects it publishes by
// hand under them, in the orders a worker with several jobs in flight
// completes jobs; the runner verifies epochs and reads committed progress
// from the lease bucket, as `leasehold sink` does.
type proofLog struct {
	t      *testing.T
	js     jetstream.JetStream
	scope  string
	bucket *coordinator.Bucket
	runner *running
	rec    *positions

	mu        sync.Mutex
	keys      []string          // applied, in order
	data      map[string]string // key -> data applied
	applies   chan struct{}
	decisions chan struct{} // signalled after each decision reported
}

func newProofLog(t *testing.T, scope string) *proofLog {
	t.Helper()
	return newProofLogWith(t, scope, nil)
}

// newProofLogWith is newProofLog with the runner's Config changed by set.
func newProofLogWith(t *testing.T, scope string, set func(*streamsink.Config)) *proofLog {
	t.Helper()
	pl, observer := newProofWorld(t, scope)
	cfg := streamsink.Config{Prefix: scope, Verifier: pl.bucket, Observer: observer, MaxBackoff: 10 * time.Millisecond,
		Handler: func(_ context.Context, e sink.Effect) error {
			pl.apply(e)
			return nil
		}}
	if set != nil {
		set(&cfg)
	}
	pl.runner = start(t, pl.js, cfg)
	return pl
}

// newProofWorld starts a server with a job stream of one partition under
// scope and its lease bucket, and returns the proofLog of it, without a
// runner, and the observer that records the runner's decisions in it.
func newProofWorld(t *testing.T, scope string) (*proofLog, sink.Observer) {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	pl := &proofLog{t: t, js: js, scope: scope, bucket: provisionJobs(t, js, scope, 1), rec: &positions{}, data: map[string]string{},
		applies: make(chan struct{}, 1), decisions: make(chan struct{}, 1)}
	notify := sink.ObserverFunc(func(context.Context, sink.Decision) {
		select {
		case pl.decisions <- struct{}{}:
		default:
		}
	})
	return pl, sink.Observers{pl.rec, notify}
}

// apply records effects as applied, in order, and signals applies.
func (pl *proofLog) apply(effects ...sink.Effect) {
	pl.mu.Lock()
	for _, e := range effects {
		pl.keys = append(pl.keys, e.Stamp.Key)
		pl.data[e.Stamp.Key] = string(e.Data)
	}
	pl.mu.Unlock()
	select {
	case pl.applies <- struct{}{}:
	default:
	}
}

// acquire takes partition 0 for worker id and writes the lease's barrier.
func (pl *proofLog) acquire(id string) *coordinator.Lease {
	pl.t.Helper()
	c, err := coordinator.New(pl.bucket, coordinator.Config{Worker: id, TTL: 10 * time.Second, Partitions: 1, Logger: quiet()})
	if err != nil {
		pl.t.Fatal(err)
	}
	l, err := c.Acquire(ctxFor(pl.t, 30*time.Second), 0)
	if err != nil {
		pl.t.Fatal(err)
	}
	pl.t.Cleanup(func() { _ = l.Release(context.Background()) })
	info := l.Info()
	h := nats.Header{leasehold.HeaderBarrier: []string{"1"}}
	info.Stamp(leasehold.BarrierKey(pl.scope, 0, info.Epoch)).SetHeader(h)
	pl.publish(h, nil)
	return l
}

func (pl *proofLog) publish(h nats.Header, data []byte) uint64 {
	pl.t.Helper()
	ack, err := pl.js.PublishMsg(ctxFor(pl.t, 30*time.Second), &nats.Msg{Subject: pl.scope + ".out.0", Header: h, Data: data})
	if err != nil {
		pl.t.Fatal(err)
	}
	return ack.Sequence
}

// pub publishes a message of job mark.Job under lease l: effect i, or an
// abort marker.
func (pl *proofLog) pub(l *coordinator.Lease, mark leasehold.JobMark, i int) uint64 {
	pl.t.Helper()
	key := pl.key(mark.Job, i)
	if mark.Abort {
		key = worker.AbortKey(pl.scope, 0, mark.Job, mark.Attempt)
	}
	h := nats.Header{}
	l.Info().Stamp(key).SetHeader(h)
	mark.SetHeader(h)
	var data []byte
	if !mark.Abort {
		data = fmt.Appendf(nil, "%s attempt %d", key, mark.Attempt)
	}
	return pl.publish(h, data)
}

func (pl *proofLog) key(job uint64, i int) string { return leasehold.EffectKey(pl.scope, 0, job, i) }

func (pl *proofLog) effect(l *coordinator.Lease, job, attempt uint64, i int) uint64 {
	return pl.pub(l, leasehold.JobMark{Job: job, Attempt: attempt}, i)
}

func (pl *proofLog) final(l *coordinator.Lease, job, attempt uint64, i int, after, floor uint64) uint64 {
	return pl.pub(l, leasehold.JobMark{Job: job, Attempt: attempt, Effects: i + 1, After: after, Floor: floor, Floored: true}, i)
}

func (pl *proofLog) abort(l *coordinator.Lease, job, attempt uint64) uint64 {
	return pl.pub(l, leasehold.JobMark{Job: job, Attempt: attempt, Abort: true}, 0)
}

// decided waits until the runner has decided log position seq.
func (pl *proofLog) decided(seq uint64) {
	pl.t.Helper()
	if err := pl.runner.WaitPosition(ctxFor(pl.t, time.Minute), seq); err != nil {
		pl.t.Fatal(err)
	}
}

func (pl *proofLog) applied() []string {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	return slices.Clone(pl.keys)
}

// awaitApplied waits until the runner applied key (it may wait for its
// next read of the fence records).
func (pl *proofLog) awaitApplied(key string) {
	pl.t.Helper()
	ctx := ctxFor(pl.t, time.Minute)
	for !slices.Contains(pl.applied(), key) {
		select {
		case <-pl.applies:
		case <-ctx.Done():
			pl.t.Fatalf("%s was not applied within a minute; applied %v", key, pl.applied())
		}
	}
}

// outcome checks the decision on log position seq, once it is reported: a
// job's decisions are reported after its effects are handed over, and an
// attempt a record settles is decided in a batch of its own.
func (pl *proofLog) outcome(seq uint64, want sink.Outcome) {
	pl.t.Helper()
	ctx := ctxFor(pl.t, time.Minute)
	for {
		if _, ok := pl.rec.at(seq); ok {
			break
		}
		select {
		case <-pl.decisions:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
	}
	if d, ok := pl.rec.at(seq); !ok || d.Outcome != want {
		pl.t.Errorf("log position %d: outcome %v (reported %v, %s), want %v", seq, d.Outcome, ok, d.Suspect, want)
	}
}

// With the fence record to read, a floor proves nothing by itself: a job
// whose floor passes another open job of its lease applies once its After
// holds, beside it, and settles nothing but itself; the open job waits
// until it completes or the record settles it (here: committed, so its
// attempt never completes).
func TestOutOfOrderFloorWaitsForProof(t *testing.T) {
	t.Parallel()
	pl := newProofLog(t, "oproof")
	l := pl.acquire("w1")
	e3 := pl.effect(l, 3, 3, 0)      // job 3 runs
	f5 := pl.final(l, 5, 5, 0, 0, 2) // job 5 completes first, jobs 1 and 2 finished
	pl.decided(f5)
	if got := pl.applied(); !slices.Equal(got, []string{pl.key(5, 0)}) {
		t.Fatalf("applied %v, want job 5 beside job 3 still running", got)
	}
	f3 := pl.final(l, 3, 3, 1, 5, 2) // job 3 completes after it
	pl.decided(f3)
	dead := pl.effect(l, 4, 6, 0)    // job 4 goes to the dead-letter stream after this effect
	f6 := pl.final(l, 6, 7, 0, 3, 5) // watermark 5: job 4 finished
	pl.decided(f6)
	want := []string{pl.key(5, 0), pl.key(3, 0), pl.key(3, 1), pl.key(6, 0)}
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Fatalf("applied %v, want %v: job 6 applies beside job 4, open", got, want)
	}
	if _, ok := pl.rec.at(dead); ok {
		t.Fatal("job 4's attempt was settled by a floor alone")
	}
	// The worker commits its watermark 5 and job 6 done above it.
	if err := l.Commit(ctxFor(t, 30*time.Second), 5, 6); err != nil {
		t.Fatal(err)
	}
	pl.outcome(dead, sink.Aborted)
	pl.outcome(e3, sink.Accepted)
	pl.outcome(f6, sink.Accepted)
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
}

// A final's floor passes a job of its lease that has nothing in the log
// yet: that job, completing later, still applies (the floor settled
// nothing), and so does a job whose After names it.
func TestOutOfOrderFloorPassesJobNotInLog(t *testing.T) {
	t.Parallel()
	pl := newProofLog(t, "opass")
	l := pl.acquire("w1")
	f5 := pl.final(l, 5, 1, 0, 0, 4) // claims every job up to 4 finished; job 3 runs, nothing of it in the log
	pl.decided(f5)
	f3 := pl.final(l, 3, 2, 0, 5, 0)
	f6 := pl.final(l, 6, 3, 0, 3, 5)
	pl.decided(f6)
	want := []string{pl.key(5, 0), pl.key(3, 0), pl.key(6, 0)}
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Fatalf("applied %v, want %v", got, want)
	}
	pl.outcome(f3, sink.Accepted)
	pl.outcome(f6, sink.Accepted)
}

// With the fence record to read, a chain's floor rises with the progress
// the record shows, not with the finals: jobs of a sequential runner (no
// floors) stay in the chain's set until the worker commits them, then
// leave it, and an effect of a job below the floor coming again is a
// duplicate while a job whose After names one applies.
func TestProvenFloorRisesWithTheRecord(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	pl := newProofLogWith(t, "orise", func(c *streamsink.Config) {
		c.Telemetry = telemetry.Config{MeterProvider: mp}
		c.Name = "orise"
	})
	l := pl.acquire("w1")
	var last uint64
	for job := uint64(1); job <= 5; job++ {
		last = pl.pub(l, leasehold.JobMark{Job: job, Attempt: job, Effects: 1, After: job - 1}, 0) // no floor
	}
	pl.decided(last)
	if n := sinkMetric(t, reader, "orise", "leasehold.sink.jobs_above_floor"); n != 5 {
		t.Errorf("leasehold.sink.jobs_above_floor is %d, want 5 before the worker commits", n)
	}
	if err := l.Commit(ctxFor(t, 30*time.Second), 5); err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, time.Minute)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for sinkMetric(t, reader, "orise", "leasehold.sink.jobs_above_floor") != 0 {
		select {
		case <-tick.C:
		case <-ctx.Done():
			t.Fatal("the chain's floor did not rise to the committed watermark within a minute")
		}
	}
	again := pl.pub(l, leasehold.JobMark{Job: 2, Attempt: 2, Effects: 1, After: 1}, 0)
	f7 := pl.final(l, 7, 7, 0, 5, 0)
	pl.outcome(again, sink.Duplicate)
	pl.outcome(f7, sink.Accepted)
	want := []string{pl.key(1, 0), pl.key(2, 0), pl.key(3, 0), pl.key(4, 0), pl.key(5, 0), pl.key(7, 0)}
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
}

// A job that a lease committed beyond its watermark (in the fence record's
// done set) is settled by the record: an attempt of it still incomplete is
// dropped, and one that first appears after the runner read the record is
// not the worker's.
func TestOutOfOrderDoneSetSettles(t *testing.T) {
	t.Parallel()
	pl := newProofLog(t, "odone")
	l := pl.acquire("w1")
	pl.effect(l, 1, 1, 0) // job 1 runs all along
	failed := pl.effect(l, 2, 2, 0)
	pl.abort(l, 2, 2) // a hint: the attempt waits for the record
	pl.effect(l, 2, 3, 0)
	f2 := pl.final(l, 2, 3, 1, 0, 0)
	pl.decided(f2)
	if got := pl.applied(); len(got) != 0 {
		t.Fatalf("applied %v before the record settled job 2's first attempt", got)
	}
	// Job 1 still runs: the watermark stays 0, and jobs 2 and 7 (which had
	// nothing to publish here) are done above it.
	if err := l.Commit(ctxFor(t, 30*time.Second), 0, 2, 7); err != nil {
		t.Fatal(err)
	}
	pl.awaitApplied(pl.key(2, 1))
	pl.outcome(failed, sink.Aborted)
	late := pl.effect(l, 7, 9, 0)
	pl.decided(late)
	if d, _ := pl.rec.at(late); d.Outcome != sink.Aborted || d.Suspect != streamsink.SuspectAfterCommit {
		t.Errorf("an attempt of job 7, done, that came after the record was read: %v %q, want aborted as %q", d.Outcome, d.Suspect, streamsink.SuspectAfterCommit)
	}
	f1 := pl.final(l, 1, 1, 1, 2, 0)
	pl.awaitApplied(pl.key(1, 1))
	pl.outcome(f1, sink.Accepted)
}

// A successor's barrier settles the earlier lease: what it completed out
// of order and whose After holds applies, in the order it completed, and
// what cannot apply is dropped.
func TestOutOfOrderSuccessorSettles(t *testing.T) {
	t.Parallel()
	pl := newProofLog(t, "osucc")
	l1 := pl.acquire("w1")
	pl.final(l1, 3, 1, 0, 0, 0)      // job 3 completes first
	failed := pl.effect(l1, 1, 2, 0) // job 1's first attempt fails
	pl.abort(l1, 1, 2)
	pl.effect(l1, 1, 4, 0)
	f1 := pl.final(l1, 1, 4, 1, 3, 0) // its retry completes, after job 3
	f2 := pl.final(l1, 2, 5, 0, 1, 0) // job 2 after job 1
	open := pl.effect(l1, 4, 6, 0)    // job 4 runs when the lease ends
	pl.decided(open)
	if got := pl.applied(); !slices.Equal(got, []string{pl.key(3, 0)}) {
		t.Fatalf("applied %v, want job 3 alone: job 1 waits for the record, and job 2 for job 1", got)
	}
	if err := l1.Release(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	l2 := pl.acquire("w2")
	next := pl.final(l2, 4, 1, 0, 0, 0)
	pl.decided(next)
	want := []string{pl.key(3, 0), pl.key(1, 0), pl.key(1, 1), pl.key(2, 0), pl.key(4, 0)}
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
	pl.outcome(failed, sink.Aborted)
	pl.outcome(open, sink.Aborted)
	pl.outcome(f1, sink.Accepted)
	pl.outcome(f2, sink.Accepted)
	late := pl.final(l1, 4, 6, 1, 2, 3)
	pl.decided(late)
	pl.outcome(late, sink.Stale)
}

// An attempt whose After names a later job, one that completed before it
// on the subject, is not passed over as hopeless once its job is committed
// while that later job may still apply: a copy a forger made of it, with
// After 0, ranked after it, must not apply instead.
func TestOutOfOrderAfterALaterJobWaits(t *testing.T) {
	t.Parallel()
	pl := newProofLog(t, "olater")
	l := pl.acquire("w1")
	pl.effect(l, 5, 1, 0) // job 5's first attempt fails: it waits for the record
	pl.abort(l, 5, 1)
	pl.final(l, 5, 2, 0, 0, 0) // its retry completes
	pl.final(l, 2, 3, 0, 5, 0) // job 2 completes after job 5
	forged := pl.final(l, 2, 4, 0, 0, 0)
	pl.decided(forged)
	if got := pl.applied(); len(got) != 0 {
		t.Fatalf("applied %v before the record settled job 5's first attempt", got)
	}
	if err := l.Commit(ctxFor(t, 30*time.Second), 0, 2, 5); err != nil {
		t.Fatal(err)
	}
	pl.awaitApplied(pl.key(2, 0))
	want := []string{pl.key(5, 0), pl.key(2, 0)}
	if got := pl.applied(); !slices.Equal(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if got, want := pl.data[pl.key(2, 0)], pl.key(2, 0)+" attempt 3"; got != want {
		t.Errorf("job 2 applied as %q, want %q: the worker's attempt, not the copy ranked after it", got, want)
	}
}

// A final forged under the holder's stamp for the attempt the worker then
// runs, with an After that never holds, comes first and stands: the
// worker's own final of that attempt is set aside, and the job, once the
// worker commits it, can never apply. That is a forgery of the holder's
// exact stamp and key (the documented residual); it must not be silent:
// the job is counted stuck, and Ready fails after StallAfter, naming it.
func TestForgedFinalThatNeverAppliesIsVisible(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	pl := newProofLogWith(t, "ostuck", func(c *streamsink.Config) {
		c.Telemetry = telemetry.Config{MeterProvider: mp}
		c.Name = "ostuck"
		c.StallAfter = time.Second
	})
	l := pl.acquire("w1")
	forged := pl.final(l, 3, 1, 0, 2, 0) // After 2: job 2 has nothing on this subject
	own := pl.final(l, 3, 1, 0, 0, 0)    // the worker's: After 0
	pl.decided(own)
	if d, _ := pl.rec.at(own); d.Outcome != sink.Aborted || d.Suspect != streamsink.SuspectFinalConflict {
		t.Errorf("the worker's final after the forged one: %v %q, want set aside as %q", d.Outcome, d.Suspect, streamsink.SuspectFinalConflict)
	}
	if err := l.Commit(ctxFor(t, 30*time.Second), 3); err != nil {
		t.Fatal(err)
	}
	err := awaitReady(t, ctxFor(t, time.Minute), pl.runner.Runner, "the stuck job", func(err error) bool {
		return err != nil && strings.Contains(err.Error(), "cannot apply")
	})
	if !strings.Contains(err.Error(), "job 3 ") {
		t.Errorf("Ready: %v, want it to name job 3", err)
	}
	if n := sinkMetric(t, reader, "ostuck", "leasehold.sink.jobs_stuck"); n != 1 {
		t.Errorf("leasehold.sink.jobs_stuck is %d, want 1", n)
	}
	if _, ok := pl.rec.at(forged); ok {
		t.Error("the forged final was decided: applied or dropped")
	}
}

// With committed progress to read, a chain at its bound of jobs above its
// floor (the worker has not committed them yet, or the runner catches up)
// forgets the lowest, counted, and goes on: nothing is refused or stops,
// and once the worker commits, the floor rises over what is left.
func TestProvenChainAtItsBoundForgets(t *testing.T) {
	defer streamsink.SetMaxAbove(3)()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	pl := newProofLogWith(t, "oforget", func(c *streamsink.Config) {
		c.Telemetry = telemetry.Config{MeterProvider: mp}
		c.Name = "oforget"
	})
	l := pl.acquire("w1")
	var finals []uint64
	for job := uint64(1); job <= 5; job++ {
		finals = append(finals, pl.pub(l, leasehold.JobMark{Job: job, Attempt: job, Effects: 1, After: job - 1}, 0))
	}
	pl.decided(finals[4])
	for _, f := range finals {
		pl.outcome(f, sink.Accepted)
	}
	if n := sinkMetric(t, reader, "oforget", "leasehold.sink.jobs_above_floor"); n != 3 {
		t.Errorf("leasehold.sink.jobs_above_floor is %d, want 3", n)
	}
	if n := sinkMetric(t, reader, "oforget", "leasehold.sink.jobs_forgotten"); n != 2 {
		t.Errorf("leasehold.sink.jobs_forgotten is %d, want 2", n)
	}
	if err := pl.runner.Ready(context.Background()); err != nil {
		t.Errorf("Ready: %v", err)
	}
	again := pl.pub(l, leasehold.JobMark{Job: 4, Attempt: 4, Effects: 1, After: 3}, 0)
	pl.outcome(again, sink.Duplicate) // still remembered
	if err := l.Commit(ctxFor(t, 30*time.Second), 5); err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, time.Minute)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for sinkMetric(t, reader, "oforget", "leasehold.sink.jobs_above_floor") != 0 {
		select {
		case <-tick.C:
		case <-ctx.Done():
			t.Fatal("the chain's floor did not rise to the committed watermark within a minute")
		}
	}
	f6 := pl.final(l, 6, 6, 0, 5, 0)
	pl.outcome(f6, sink.Accepted)
}
