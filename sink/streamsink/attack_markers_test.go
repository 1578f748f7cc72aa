package streamsink_test

import (
	"context"
	"errors"
	"fmt"
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

// stepWorld is a job stream of one partition, a worker whose handler
// the test steers, and a stream sink runner that verifies epochs and reads
// committed progress from the lease bucket (the defaults of `leasehold
// sink`). A forger with a worker's credentials reads the effect log and
// publishes copies of its messages with their markers changed.
//
// The handler, by the job's payload:
//   - "one": emits one effect and returns;
//   - "two": emits two effects (the first goes to the log when the second
//     is emitted), tells the test, waits for its go, and returns;
//   - "failfirst": its first attempt emits two effects, tells the test,
//     waits for its go and fails; its next attempt emits one and returns.
//
// Every effect's data names the job's attempt, so that the test tells
// which attempt a value came from.
type stepWorld struct {
	js      jetstream.JetStream
	bucket  *coordinator.Bucket
	prefix  string
	sink    *running
	decided *attackDecisions
	events  chan worker.Event

	paused chan uint64          // a job's attempt has put its first effect in the log
	resume chan struct{}        // let it go on
	log    <-chan jetstream.Msg // the effect log, as the forger reads it
	// stopFirst stops the first worker, gracefully.
	stopFirst func()
	mu        sync.Mutex          // guards values
	values    map[string][]string // key -> data applied, in order
	applies   chan struct{}       // a value was applied
}

const stepPrefix = "atkmarkers"

func newStepWorld(t *testing.T) *stepWorld { return newStepWorldWith(t, nil) }

// newStepWorldWith builds the world; wrap, when set, stands between the
// runner and the lease bucket's committed progress.
func newStepWorldWith(t *testing.T, wrap func(sink.ProgressReader) sink.ProgressReader) *stepWorld {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	bucket := provisionJobs(t, js, stepPrefix, 1)
	mw := &stepWorld{js: js, bucket: bucket, prefix: stepPrefix,
		decided: &attackDecisions{at: map[uint64]sink.Decision{}, new: make(chan struct{}, 1)},
		events:  make(chan worker.Event, 4096), paused: make(chan uint64, 16), resume: make(chan struct{}, 16),
		values: map[string][]string{}, applies: make(chan struct{}, 1)}
	var progress sink.ProgressReader
	if wrap != nil {
		progress = wrap(bucket)
	}
	mw.sink = start(t, js, streamsink.Config{Prefix: stepPrefix, Verifier: bucket, Progress: progress, Observer: mw.decided, MaxBackoff: 10 * time.Millisecond,
		Handler: func(_ context.Context, e sink.Effect) error {
			mw.mu.Lock()
			mw.values[e.Stamp.Key] = append(mw.values[e.Stamp.Key], string(e.Data))
			mw.mu.Unlock()
			select {
			case mw.applies <- struct{}{}:
			default:
			}
			return nil
		}})
	// The forger reads the effect log as it is written.
	mw.log = tailLog(t, js, stepPrefix)
	mw.stopFirst = mw.startWorker(t, "w1")
	return mw
}

// startWorker runs a worker with the steered handler until the returned
// function stops it (gracefully: it drains and releases the partition).
func (mw *stepWorld) startWorker(t *testing.T, id string) (stop func()) {
	t.Helper()
	cfg := workerConfig(mw.js, stepPrefix, mw.bucket, id, worker.HandlerFunc(mw.handle))
	cfg.Observer = forwardEvents(mw.events)
	return runWorker(t, cfg)
}

var errStepFails = errors.New("this attempt fails on purpose")

func (mw *stepWorld) handle(ctx context.Context, j *worker.Job) error {
	data := func(i int) []byte { return []byte(fmt.Sprintf("job %d attempt %d effect %d", j.Seq, j.Attempt, i)) }
	mode := string(j.Data)
	if mode == "one" || mode == "failfirst" && j.Attempt > 1 {
		return j.Emit(ctx, data(0))
	}
	if err := j.Emit(ctx, data(0)); err != nil {
		return err
	}
	if err := j.Emit(ctx, data(1)); err != nil {
		return err
	}
	mw.paused <- j.Seq
	select {
	case <-mw.resume:
	case <-ctx.Done():
		return ctx.Err()
	}
	if mode == "failfirst" {
		return errStepFails
	}
	return nil
}

// enqueue enqueues a job whose payload steers the handler.
func (mw *stepWorld) enqueue(t *testing.T, mode string) uint64 {
	t.Helper()
	p := producerOf(t, mw.js, mw.prefix)
	e, err := p.EnqueueTo(ctxFor(t, 10*time.Second), 0, []byte(mode))
	if err != nil {
		t.Fatal(err)
	}
	return e.Seq
}

// pausedAt waits until the handler of job seq has paused and its first
// effect is in the log, and returns that message as the forger read it.
func (mw *stepWorld) pausedAt(t *testing.T, seq uint64) logMsg {
	t.Helper()
	awaitPause(t, mw.paused, seq)
	return effectInLog(t, mw.log, seq, false)
}

// forge publishes a copy of m with its job marks replaced by mark, its key
// by key (when set), and data.
func (mw *stepWorld) forge(t *testing.T, m logMsg, mark leasehold.JobMark, key string, data []byte) uint64 {
	t.Helper()
	h := restamp(t, m, key)
	mark.SetHeader(h)
	ack, err := mw.js.PublishMsg(ctxFor(t, 10*time.Second), &nats.Msg{Subject: m.subject, Header: h, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

// settle waits until the worker committed up to seq and the runner decided
// the whole log.
func (mw *stepWorld) settle(t *testing.T, seq uint64) {
	t.Helper()
	awaitCommitted(t, ctxFor(t, time.Minute), mw.events, seq)
	settleLog(t, mw.js, mw.prefix, mw.sink)
}

// applied is what the runner applied for job seq's effect index i.
func (mw *stepWorld) applied(seq uint64, i int) []string {
	mw.mu.Lock()
	defer mw.mu.Unlock()
	return mw.values[leasehold.EffectKey(mw.prefix, 0, seq, i)]
}

// wantApplied fails unless job seq's effects 0..n-1 were each applied
// once, from the given handler attempt. A job the runner holds until it
// has read the job's committed progress (an abort marker before its final
// put it in doubt) is applied after that read: it is waited for.
func (mw *stepWorld) wantApplied(t *testing.T, seq uint64, n, attempt int) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	for i := 0; i < n; {
		if len(mw.applied(seq, i)) > 0 {
			i++
			continue
		}
		select {
		case <-mw.applies:
		case <-ctx.Done():
			t.Errorf("job %d effect %d was not applied", seq, i)
			return
		}
	}
	for i := range n {
		want := fmt.Sprintf("job %d attempt %d effect %d", seq, attempt, i)
		if got := mw.applied(seq, i); len(got) != 1 || got[0] != want {
			t.Errorf("job %d effect %d: applied %q, want %q once", seq, i, got, want)
		}
	}
}

// An abort marker copying the stamp and job marks of an attempt in
// flight (its first effect is in the log, its final not yet) must not
// cost the job: the worker completes the attempt and commits it.
func TestAttackAbortCopyOfAttemptInFlight(t *testing.T) {
	t.Parallel()
	mw := newStepWorld(t)
	first := mw.enqueue(t, "one")
	seq := mw.enqueue(t, "two")
	m := mw.pausedAt(t, seq)
	mark, _ := leasehold.JobMarkFromHeader(m.header)
	st, _ := leasehold.StampFromHeader(m.header)
	mw.forge(t, m, leasehold.JobMark{Job: seq, Attempt: mark.Attempt, Abort: true},
		fmt.Sprintf("%s.%d.%d.abort.%d", st.Scope, st.Partition, seq, mark.Attempt), nil)
	mw.resume <- struct{}{}
	last := mw.enqueue(t, "one")
	mw.settle(t, last)
	mw.wantApplied(t, first, 1, 1)
	mw.wantApplied(t, seq, 2, 1)
	mw.wantApplied(t, last, 1, 1)
}

// Abort markers with the largest attempt number for the next jobs of the
// partition, under the live lease's stamp, published before those jobs
// run: every one of them must still be applied.
func TestAttackAbortAheadOfProgress(t *testing.T) {
	t.Parallel()
	mw := newStepWorld(t)
	first := mw.enqueue(t, "one")
	seq := mw.enqueue(t, "two")
	m := mw.pausedAt(t, seq)
	st, _ := leasehold.StampFromHeader(m.header)
	// The next two jobs will get the next two sequences of the stream.
	for _, job := range []uint64{seq + 1, seq + 2} {
		mw.forge(t, m, leasehold.JobMark{Job: job, Attempt: leasehold.MaxAttempt, Abort: true},
			fmt.Sprintf("%s.%d.%d.abort.%d", st.Scope, st.Partition, job, leasehold.MaxAttempt), nil)
	}
	mw.resume <- struct{}{}
	a := mw.enqueue(t, "one")
	b := mw.enqueue(t, "one")
	if a != seq+1 || b != seq+2 {
		t.Fatalf("jobs %d and %d, want %d and %d", a, b, seq+1, seq+2)
	}
	mw.settle(t, b)
	mw.wantApplied(t, first, 1, 1)
	mw.wantApplied(t, seq, 2, 1)
	mw.wantApplied(t, a, 1, 1)
	mw.wantApplied(t, b, 1, 1)
}

// While a job's attempt is in flight (its first effect in the log), a
// forged final of the next job, which has not run yet, claims one effect
// and names no job before it (After 0), under the live lease's stamp. It
// may be applied (a forged copy of the holder's stamp is what a worker's
// credentials can always write), but it must not cost the job in flight,
// which the worker completes and commits, nor the next job's own run.
func TestAttackForgedFinalAheadSkipsJobInFlight(t *testing.T) {
	t.Parallel()
	mw := newStepWorld(t)
	first := mw.enqueue(t, "one")
	seq := mw.enqueue(t, "two")
	m := mw.pausedAt(t, seq)
	next := seq + 1
	mw.forge(t, m, leasehold.JobMark{Job: next, Attempt: leasehold.MaxAttempt, Effects: 1, After: 0},
		leasehold.EffectKey(mw.prefix, 0, next, 0), []byte("forged effect of the next job"))
	mw.resume <- struct{}{}
	if got := mw.enqueue(t, "one"); got != next {
		t.Fatalf("the next job is %d, want %d", got, next)
	}
	mw.settle(t, next)
	mw.wantApplied(t, first, 1, 1)
	mw.wantApplied(t, seq, 2, 1)
	if got := mw.applied(next, 0); len(got) != 1 {
		t.Errorf("job %d: applied %q, want one value", next, got)
	}
}

// slowProgress is a progress reader whose reads wait while held: the
// fence bucket answering slowly, on a busy machine.
type slowProgress struct {
	inner sink.ProgressReader
	mu    sync.Mutex
	held  chan struct{} // closed when reads may go on; nil when not held
}

func (s *slowProgress) Committed(ctx context.Context, id leasehold.FenceID) (sink.Progress, error) {
	s.mu.Lock()
	held := s.held
	s.mu.Unlock()
	if held != nil {
		select {
		case <-held:
		case <-ctx.Done():
			return sink.Progress{}, ctx.Err()
		}
	}
	return s.inner.Committed(ctx, id)
}

func (s *slowProgress) hold() {
	s.mu.Lock()
	s.held = make(chan struct{})
	s.mu.Unlock()
}

func (s *slowProgress) release() {
	s.mu.Lock()
	if s.held != nil {
		close(s.held)
		s.held = nil
	}
	s.mu.Unlock()
}

// A job's first attempt puts an effect into the log and fails; its second
// completes, and the worker commits the job. The runner holds the second
// attempt back until the fence record proves the first can never complete
// (its abort marker proves nothing on its own), and the record is slow to
// answer (a busy machine). Meanwhile the partition is handed to another
// worker, whose barrier reaches the runner. The job was committed by the
// lease that ran it: its completed attempt must be applied, not dropped
// with the open attempts of the lease the barrier ends.
func TestAttackHandOffWhileProofIsSlow(t *testing.T) {
	t.Parallel()
	slow := &slowProgress{}
	mw := newStepWorldWith(t, func(b sink.ProgressReader) sink.ProgressReader { slow.inner = b; return slow })
	defer slow.release()
	first := mw.enqueue(t, "one")
	mw.settle(t, first)
	slow.hold()
	seq := mw.enqueue(t, "failfirst")
	mw.pausedAt(t, seq)
	mw.resume <- struct{}{}
	// The worker commits the job (its second attempt completed).
	ctx := ctxFor(t, 30*time.Second)
	for committed := false; !committed; {
		select {
		case e := <-mw.events:
			committed = e.Kind == worker.EventProgressCommitted && e.Seq >= seq
		case <-ctx.Done():
			t.Fatal("the worker did not commit the job")
		}
	}
	// The worker is stopped (a deploy); another takes the partition.
	mw.stopFirst()
	stop2 := mw.startWorker(t, "w2")
	defer stop2()
	for moved := false; !moved; {
		select {
		case e := <-mw.events:
			moved = e.Kind == worker.EventBarrierWritten && e.Lease.Holder == "w2"
		case <-ctx.Done():
			t.Fatal("the partition did not move to the second worker")
		}
	}
	slow.release()
	last := mw.enqueue(t, "one")
	mw.settle(t, last)
	mw.wantApplied(t, first, 1, 1)
	mw.wantApplied(t, seq, 1, 2)
	if got := mw.applied(last, 0); len(got) != 1 {
		t.Errorf("job %d: applied %q, want once", last, got)
	}
}
