package streamsink_test

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// Attacks on Leasehold-Floor from outside: a credential that may publish
// on the effect log (a worker's) reads the live lease's stamp from the log
// and publishes finals whose floor claims that jobs of the lease are
// finished when they are not, or that do not parse. The worker runs
// several jobs of its partition at once, as it does by default, and the
// runner verifies epochs and reads committed progress from the lease
// bucket, as `leasehold sink` does.

// floorWorld is a job stream of one partition, a worker with several jobs
// of it in flight whose handler the test steers, a stream sink runner and
// a forger reading the effect log.
//
// The handler, by the job's payload:
//   - "one": emits one effect and returns;
//   - "hold": emits one effect (the worker holds it back as the job's
//     final until the handler returns, so nothing of the job is in the
//     log), tells the test, waits for its go, and returns;
//   - "two": emits two effects (the first goes to the log when the second
//     is emitted), tells the test, waits for its go, and returns.
type floorWorld struct {
	js     jetstream.JetStream
	bucket *coordinator.Bucket
	prefix string
	sink   *running
	dec    *attackDecisions
	events chan worker.Event
	prod   *worker.Producer

	paused chan uint64
	resume map[uint64]chan struct{}
	rmu    sync.Mutex
	log    <-chan jetstream.Msg

	mu      sync.Mutex
	forged  map[uint64]bool // log positions the forger wrote
	values  map[string][]string
	applies chan struct{}
}

const floorPrefix = "atkfloor"

func newFloorWorld(t *testing.T) *floorWorld { return newFloorWorldWith(t, 4) }

// newFloorWorldWith runs the worker with concurrency jobs of the
// partition at once (1: one at a time, whose finals carry no floor).
func newFloorWorldWith(t *testing.T, concurrency int) *floorWorld {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	bucket := provisionJobs(t, js, floorPrefix, 1)
	fw := &floorWorld{js: js, bucket: bucket, prefix: floorPrefix,
		dec:    &attackDecisions{at: map[uint64]sink.Decision{}, new: make(chan struct{}, 1)},
		events: make(chan worker.Event, 4096), paused: make(chan uint64, 16), resume: map[uint64]chan struct{}{},
		values: map[string][]string{}, forged: map[uint64]bool{}, applies: make(chan struct{}, 1)}
	fw.prod = producerOf(t, js, floorPrefix)
	fw.sink = start(t, js, streamsink.Config{Prefix: floorPrefix, Verifier: bucket, Observer: fw.dec, MaxBackoff: 10 * time.Millisecond,
		Handler: func(_ context.Context, e sink.Effect) error {
			fw.mu.Lock()
			fw.values[e.Stamp.Key] = append(fw.values[e.Stamp.Key], string(e.Data))
			fw.mu.Unlock()
			select {
			case fw.applies <- struct{}{}:
			default:
			}
			return nil
		}})
	fw.log = tailLog(t, js, floorPrefix)
	cfg := workerConfig(js, floorPrefix, bucket, "w1", worker.HandlerFunc(fw.handle))
	cfg.PartitionConcurrency = concurrency
	cfg.Observer = forwardEvents(fw.events)
	runWorker(t, cfg)
	// Before the worker stops: handlers still paused return.
	t.Cleanup(func() {
		fw.rmu.Lock()
		defer fw.rmu.Unlock()
		for seq, c := range fw.resume {
			select {
			case <-c:
			default:
				close(c)
			}
			delete(fw.resume, seq)
		}
	})
	return fw
}

func (fw *floorWorld) gate(seq uint64) chan struct{} {
	fw.rmu.Lock()
	defer fw.rmu.Unlock()
	c := fw.resume[seq]
	if c == nil {
		c = make(chan struct{})
		fw.resume[seq] = c
	}
	return c
}

// release lets job seq's paused handler return.
func (fw *floorWorld) release(seq uint64) { close(fw.gate(seq)) }

func (fw *floorWorld) handle(ctx context.Context, j *worker.Job) error {
	data := func(i int) []byte { return []byte(fmt.Sprintf("job %d attempt %d effect %d", j.Seq, j.Attempt, i)) }
	mode := string(j.Data)
	if err := j.Emit(ctx, data(0)); err != nil {
		return err
	}
	if mode == "one" {
		return nil
	}
	if mode == "two" {
		if err := j.Emit(ctx, data(1)); err != nil {
			return err
		}
	}
	fw.paused <- j.Seq
	select {
	case <-fw.gate(j.Seq):
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// enqueue enqueues a job under partition key key.
func (fw *floorWorld) enqueue(t *testing.T, key, mode string) uint64 {
	t.Helper()
	e, err := fw.prod.Enqueue(ctxFor(t, 10*time.Second), []byte(key), []byte(mode))
	if err != nil {
		t.Fatal(err)
	}
	return e.Seq
}

// waitPaused waits until job seq's handler has paused.
func (fw *floorWorld) waitPaused(t *testing.T, seq uint64) {
	t.Helper()
	awaitPause(t, fw.paused, seq)
}

// stampOf waits until an effect of job seq is in the log (its final, when
// final) and returns it as the forger read it.
func (fw *floorWorld) stampOf(t *testing.T, seq uint64, final bool) logMsg {
	t.Helper()
	return effectInLog(t, fw.log, seq, final)
}

// publish stores a message with m's stamp (key replaced) and the given
// job headers, written raw so that malformed values go out as they are.
func (fw *floorWorld) publish(t *testing.T, m logMsg, key string, jobHeaders map[string]string, data []byte) uint64 {
	t.Helper()
	h := restamp(t, m, key)
	for k, v := range jobHeaders {
		h.Set(k, v)
	}
	return fw.store(t, m.subject, h, data)
}

// store publishes a forged message and notes its log position.
func (fw *floorWorld) store(t *testing.T, subject string, h nats.Header, data []byte) uint64 {
	t.Helper()
	ack, err := fw.js.PublishMsg(ctxFor(t, 10*time.Second), &nats.Msg{Subject: subject, Header: h, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	fw.mu.Lock()
	fw.forged[ack.Sequence] = true
	fw.mu.Unlock()
	return ack.Sequence
}

// forgeFinalNoFloor publishes a final of job with one effect and After 0
// and no floor, as a sequential runner writes its finals, under m's stamp
// and the job's own key, and waits until the runner decided the log up
// to it.
func (fw *floorWorld) forgeFinalNoFloor(t *testing.T, m logMsg, job uint64) {
	t.Helper()
	pos := fw.publish(t, m, leasehold.EffectKey(fw.prefix, 0, job, 0), map[string]string{
		leasehold.HeaderJob: fmt.Sprint(job), leasehold.HeaderAttempt: "1", leasehold.HeaderEffects: "1",
		leasehold.HeaderAfter: "0",
	}, []byte("forged"))
	if err := fw.sink.WaitPosition(ctxFor(t, 10*time.Second), pos); err != nil {
		t.Fatalf("the runner did not reach the forged final at %d: %v", pos, err)
	}
}

// forgeFinal publishes a final of job with one effect, After 0, and floor,
// under m's stamp and the job's own key, and waits until the runner
// decided the log up to it.
func (fw *floorWorld) forgeFinal(t *testing.T, m logMsg, job, floor uint64) {
	t.Helper()
	pos := fw.publish(t, m, leasehold.EffectKey(fw.prefix, 0, job, 0), map[string]string{
		leasehold.HeaderJob: fmt.Sprint(job), leasehold.HeaderAttempt: "1", leasehold.HeaderEffects: "1",
		leasehold.HeaderAfter: "0", leasehold.HeaderFloor: fmt.Sprint(floor),
	}, []byte("forged"))
	if err := fw.sink.WaitPosition(ctxFor(t, 10*time.Second), pos); err != nil {
		t.Fatalf("the runner did not reach the forged final at %d: %v", pos, err)
	}
}

// settle waits until the worker committed job seq and the runner decided
// the whole log.
func (fw *floorWorld) settle(t *testing.T, seq uint64) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	for done := false; !done; {
		select {
		case e := <-fw.events:
			if e.Kind == worker.EventProgressCommitted {
				done = e.Seq >= seq
				for _, d := range e.Done {
					done = done || d == seq
				}
			}
		case <-ctx.Done():
			t.Fatalf("the worker did not commit job %d", seq)
		}
	}
	settleLog(t, fw.js, fw.prefix, fw.sink)
}

func (fw *floorWorld) applied(seq uint64, i int) []string {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	return fw.values[leasehold.EffectKey(fw.prefix, 0, seq, i)]
}

// refused is what the runner decided for the worker's effect under job
// seq's key i, when it decided it not to apply, or "".
func (fw *floorWorld) refused(seq uint64, i int) string {
	key := leasehold.EffectKey(fw.prefix, 0, seq, i)
	fw.mu.Lock()
	forged := maps.Clone(fw.forged)
	fw.mu.Unlock()
	fw.dec.mu.Lock()
	defer fw.dec.mu.Unlock()
	for pos, d := range fw.dec.at {
		if d.Stamp.Key == key && d.Outcome != sink.Accepted && !forged[pos] {
			return fmt.Sprintf("%v at log position %d (err %v)", d.Outcome, pos, d.Err)
		}
	}
	return ""
}

// wantApplied fails unless job seq's effects 0..n-1 were each applied
// once, from the worker's first attempt; a job the runner waits to prove
// is waited for.
func (fw *floorWorld) wantApplied(t *testing.T, seq uint64, n int, why string) {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	for i := 0; i < n; {
		if len(fw.applied(seq, i)) > 0 {
			i++
			continue
		}
		if r := fw.refused(seq, i); r != "" {
			t.Errorf("LOST: job %d, committed by the worker, effect %d is not applied (%s): the runner decided it %s", seq, i, why, r)
			return
		}
		select {
		case <-fw.applies:
		case <-fw.dec.new:
		case <-ctx.Done():
			t.Errorf("LOST: job %d, committed by the worker, effect %d was not applied within 10 s (%s)", seq, i, why)
			return
		}
	}
	for i := range n {
		want := fmt.Sprintf("job %d attempt 1 effect %d", seq, i)
		if got := fw.applied(seq, i); len(got) != 1 || got[0] != want {
			t.Errorf("job %d effect %d: applied %q, want %q once", seq, i, got, want)
		}
	}
}

// A job of the live lease is running and nothing of it is in the log yet
// (its one effect is held back until its handler returns). A forged final
// of a job far ahead, under the lease's stamp and that job's own key, with
// After 0 and a floor above the running job, reaches a chain with no open
// group. The running job then completes and the worker commits it: its
// effect must be applied, not dropped as a duplicate below the forged
// floor, and so must a job enqueued after it. It does not matter whether
// the worker runs several jobs at once or one (the runner reads a floor on
// any final), nor whether the forged final carries a floor: one without
// raises the chain's floor to its own job, the sequential runners' rule.
func TestAttackForgedFloorPassesJobNotInLog(t *testing.T) {
	t.Parallel()
	// The worker's own finals carry a floor with several jobs in flight,
	// and none with one; the forged one carries it either way.
	for _, tc := range []struct {
		concurrency int
		floor       bool
	}{{4, true}, {1, true}, {1, false}} {
		t.Run(fmt.Sprintf("concurrency=%d,floor=%v", tc.concurrency, tc.floor), func(t *testing.T) {
			fw := newFloorWorldWith(t, tc.concurrency)
			first := fw.enqueue(t, "a", "one")
			m := fw.stampOf(t, first, true)
			fw.settle(t, first)
			held := fw.enqueue(t, "b", "hold")
			fw.waitPaused(t, held)
			far := held + 1000
			how := fmt.Sprintf("a forged final of job %d without a floor raised the chain's floor to the job", far)
			if tc.floor {
				fw.forgeFinal(t, m, far, far-1)
				how = fmt.Sprintf("a forged final of job %d raised the chain's floor to %d", far, far-1)
			} else {
				fw.forgeFinalNoFloor(t, m, far)
			}
			fw.release(held)
			fw.settle(t, held)
			next := fw.enqueue(t, "c", "one")
			fw.settle(t, next)
			fw.wantApplied(t, first, 1, "applied before the forgery")
			fw.wantApplied(t, held, 1, how+" while it ran")
			fw.wantApplied(t, next, 1, "enqueued after "+how)
		})
	}
}

// The forged final need not name a job far ahead: one of the next job,
// with a floor of the running job (or, as a sequential runner writes it,
// none, which claims the next job's own), which any reader of the job
// stream can write, must not lose the running job either, whether the
// worker runs several jobs at once or one. (The next job's own effect,
// under the key the forgery took, is the documented residual of a forged
// copy of the holder's stamp, and is not checked here.)
func TestAttackForgedFloorOfTheNextJob(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		concurrency int
		floor       bool
	}{{4, true}, {4, false}, {1, true}, {1, false}} {
		t.Run(fmt.Sprintf("concurrency=%d,floor=%v", tc.concurrency, tc.floor), func(t *testing.T) {
			fw := newFloorWorldWith(t, tc.concurrency)
			first := fw.enqueue(t, "a", "one")
			m := fw.stampOf(t, first, true)
			fw.settle(t, first)
			held := fw.enqueue(t, "b", "hold")
			fw.waitPaused(t, held)
			how := fmt.Sprintf("a forged final of the next job %d without a floor came while it ran", held+1)
			if tc.floor {
				fw.forgeFinal(t, m, held+1, held)
				how = fmt.Sprintf("a forged final of the next job %d carried the floor %d while it ran", held+1, held)
			} else {
				fw.forgeFinalNoFloor(t, m, held+1)
			}
			fw.release(held)
			fw.settle(t, held)
			if got := fw.enqueue(t, "c", "one"); got != held+1 {
				t.Fatalf("the next job is %d, want %d", got, held+1)
			}
			fw.settle(t, held+1)
			after := fw.enqueue(t, "d", "one")
			fw.settle(t, after)
			fw.wantApplied(t, first, 1, "applied before the forgery")
			fw.wantApplied(t, held, 1, how)
			fw.wantApplied(t, after, 1, "enqueued after "+how)
		})
	}
}

// A forged final of the running job itself (nothing of it in the log
// yet), without a floor, that claims the keys of an earlier job through
// Leasehold-Origin, as a replayed job's effects do: the runner takes the
// job as applied, and a destination that dedupes drops the forged effect,
// whose key it applied long ago. The running job's own effect, under its
// own key, must still be applied when the worker commits it: a forgery of
// the holder's stamp may put a value under the job's key (the documented
// residual), but here nothing lands under it at all.
func TestAttackForgedOriginFinalOfRunningJob(t *testing.T) {
	t.Parallel()
	fw := newFloorWorld(t)
	first := fw.enqueue(t, "a", "one")
	m := fw.stampOf(t, first, true)
	fw.settle(t, first)
	held := fw.enqueue(t, "b", "hold")
	fw.waitPaused(t, held)
	st, err := leasehold.StampFromHeader(m.header)
	if err != nil {
		t.Fatal(err)
	}
	pos := fw.publish(t, m, leasehold.EffectKey(fw.prefix, 0, first, 0), map[string]string{
		leasehold.HeaderJob: fmt.Sprint(held), leasehold.HeaderAttempt: "1", leasehold.HeaderEffects: "1",
		leasehold.HeaderAfter: "0", leasehold.HeaderOrigin: leasehold.OriginOf(st.Scope, 0, first).String(),
	}, []byte("forged"))
	if err := fw.sink.WaitPosition(ctxFor(t, 10*time.Second), pos); err != nil {
		t.Fatal(err)
	}
	fw.release(held)
	fw.settle(t, held)
	fw.wantApplied(t, held, 1, fmt.Sprintf("a forged final of it carrying job %d's key through Leasehold-Origin was taken for it", first))
}

// The same forgery while the running job has its first effect in the log
// (an open group on the chain): the runner holds the forged final back
// while its floor would pass the open job, so the job applies. The forged
// floor reaches no further than the running job, so nothing after it is
// at stake here.
func TestAttackForgedFloorOverOpenJobWaits(t *testing.T) {
	t.Parallel()
	fw := newFloorWorld(t)
	first := fw.enqueue(t, "a", "one")
	m := fw.stampOf(t, first, true)
	fw.settle(t, first)
	running := fw.enqueue(t, "b", "two")
	fw.waitPaused(t, running)
	fw.stampOf(t, running, false) // its first effect is in the log
	fw.forgeFinal(t, m, running+1000, running)
	fw.release(running)
	fw.settle(t, running)
	next := fw.enqueue(t, "c", "one")
	fw.settle(t, next)
	fw.wantApplied(t, first, 1, "applied before the forgery")
	fw.wantApplied(t, running, 2, "its first effect was open when the forged floor came")
	fw.wantApplied(t, next, 1, "above the forged floor")
}

// Finals whose Leasehold-Floor does not parse, or breaks the rules (not
// below the job, not canonical, on an abort, repeated), under the live
// lease's stamp and keys of jobs still to come: none may be applied or
// move the chain, and the jobs they name, run later by the worker, apply.
func TestAttackMalformedFloor(t *testing.T) {
	t.Parallel()
	fw := newFloorWorld(t)
	first := fw.enqueue(t, "a", "one")
	m := fw.stampOf(t, first, true)
	fw.settle(t, first)
	next := first + 1 // the next job the producer enqueues
	key := leasehold.EffectKey(fw.prefix, 0, next, 0)
	final := func(floor string) map[string]string {
		return map[string]string{leasehold.HeaderJob: fmt.Sprint(next), leasehold.HeaderAttempt: "1",
			leasehold.HeaderEffects: "1", leasehold.HeaderAfter: "0", leasehold.HeaderFloor: floor}
	}
	bad := []map[string]string{
		final(fmt.Sprint(next)),       // not below its job
		final(fmt.Sprint(next + 5)),   // above it
		final("0" + fmt.Sprint(1)),    // not canonical
		final("-1"),                   // negative
		final("1e3"),                  // not a decimal
		final("18446744073709551616"), // overflows
		final(""),                     // empty
		{leasehold.HeaderJob: fmt.Sprint(next), leasehold.HeaderAttempt: "1", leasehold.HeaderAbort: "1", leasehold.HeaderFloor: "1"},
		{leasehold.HeaderJob: fmt.Sprint(next), leasehold.HeaderAttempt: "1", leasehold.HeaderFloor: "1"}, // a floor on an effect that is no final
	}
	var positions []uint64
	for _, hs := range bad {
		positions = append(positions, fw.publish(t, m, key, hs, []byte("garbled floor")))
	}
	// A floor given twice.
	{
		st, _ := leasehold.StampFromHeader(m.header)
		st.Key = key
		h := nats.Header{}
		st.SetHeader(h)
		for k, v := range final("1") {
			h.Set(k, v)
		}
		h.Add(leasehold.HeaderFloor, "0")
		positions = append(positions, fw.store(t, m.subject, h, []byte("two floors")))
	}
	for i, pos := range positions {
		d, ok := fw.dec.wait(ctxFor(t, 10*time.Second), pos)
		if !ok {
			t.Fatalf("malformed final %d at %d was not decided", i, pos)
		}
		if d.Outcome == sink.Accepted {
			t.Errorf("malformed final %d at %d (%v) was applied", i, pos, bad[min(i, len(bad)-1)])
		}
	}
	if got := fw.applied(next, 0); len(got) != 0 {
		t.Fatalf("job %d: a garbled final was applied: %q", next, got)
	}
	if got := fw.enqueue(t, "b", "one"); got != next {
		t.Fatalf("the next job is %d, want %d", got, next)
	}
	fw.settle(t, next)
	fw.wantApplied(t, first, 1, "applied before the forgery")
	fw.wantApplied(t, next, 1, "named by garbled finals before it ran")
}
