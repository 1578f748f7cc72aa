package worker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// enqueueBodies stores one job per body "<key>/<n>" through
// Producer.Enqueue, keyed by <key>, and returns each body's sequence.
func enqueueBodies(t *testing.T, e *env, bodies []string) map[string]uint64 {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	b := e.producer(t).Batch()
	for _, body := range bodies {
		key, _ := splitBody(body)
		if err := b.Enqueue(ctx, []byte(key), []byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	res, err := b.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seqs := map[string]uint64{}
	for i, r := range res {
		seqs[bodies[i]] = r.Seq
	}
	return seqs
}

// A job in trouble holds up its own key and nothing else: a job that
// fails and waits out its backoff again and again, one whose handler does
// not return, and one that fails until it is dead-lettered each keep the
// later jobs of their keys waiting, while every job of the partition's
// other keys runs and finishes meanwhile. Once their trouble ends, their
// keys' later jobs run, in order, and a dead-lettered job's next one
// starts only once the dead letter is stored.
func TestJobInTroubleHoldsOnlyItsKey(t *testing.T) {
	e := newEnv(t, 1)
	var bodies []string
	for n := range 4 {
		if n < 3 {
			bodies = append(bodies, fmt.Sprintf("fail/%d", n), fmt.Sprintf("hang/%d", n), fmt.Sprintf("dead/%d", n))
		}
		for k := range 5 {
			bodies = append(bodies, fmt.Sprintf("k%d/%d", k, n))
		}
	}
	seqs := enqueueBodies(t, e, bodies)

	gate := make(chan struct{}) // closed when the trouble ends
	ended := func() bool {
		select {
		case <-gate:
			return true
		default:
			return false
		}
	}
	watch := newKeyWatch()
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) (err error) {
		watch.start(j)
		defer func() {
			if worker.IsPermanent(err) {
				watch.end(j, nil) // finished for good: dead-lettered next
				return
			}
			watch.end(j, err)
		}()
		switch string(j.Data) {
		case "fail/0":
			if !ended() {
				return errors.New("not yet")
			}
		case "hang/0":
			select {
			case <-gate:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		case "dead/0":
			if ended() {
				return worker.Permanent(errors.New("given up on"))
			}
			return errors.New("not yet")
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.PartitionConcurrency = 8
	cfg.MaxAttempts = 1_000_000
	cfg.Observer = rec
	start(t, cfg)

	finished := func(prefix string) func(worker.Event) bool {
		return func(ev worker.Event) bool {
			return ev.Kind == worker.EventJobFinished && ev.Job != nil && strings.HasPrefix(string(ev.Job.Data), prefix)
		}
	}
	failedAt := func(seq uint64) func(worker.Event) bool {
		return func(ev worker.Event) bool { return ev.Kind == worker.EventJobFailed && ev.Seq == seq }
	}
	started := func(body string) func(worker.Event) bool {
		return func(ev worker.Event) bool { return ev.Kind == worker.EventJobStarted && ev.Seq == seqs[body] }
	}
	rec.waitFor(t, time.Minute, "the other keys' jobs to finish while three jobs are in trouble", func() bool {
		return rec.count(finished("k")) == 20 && rec.count(failedAt(seqs["fail/0"])) >= 3 && rec.count(failedAt(seqs["dead/0"])) >= 3 &&
			rec.count(started("hang/0")) == 1
	})
	for _, held := range []string{"fail/1", "hang/1", "dead/1"} {
		if rec.count(started(held)) != 0 {
			t.Errorf("%s started while the job before it on its key was in trouble", held)
		}
	}
	close(gate)
	rec.waitFor(t, time.Minute, "every job to finish or be dead-lettered", func() bool {
		return rec.count(kind(worker.EventJobFinished)) == len(bodies)-1 && rec.count(kind(worker.EventJobDeadLettered)) == 1
	})
	watch.check(t)
	// The dead letter of dead/0 is stored before dead/1 starts.
	var dead, next int
	for i, ev := range rec.all() {
		switch {
		case ev.Kind == worker.EventJobDeadLettered && ev.Seq == seqs["dead/0"]:
			dead = i
		case started("dead/1")(ev):
			next = i
		}
	}
	if next < dead {
		t.Errorf("dead/1 started (event %d) before dead/0's dead letter was stored (event %d)", next, dead)
	}
	// hang/0 ran from before the other keys' jobs finished until the
	// gate closed: at least two handlers ran at once. How many more did
	// is up to the scheduler, and the other keys' handlers return at once.
	if watch.peak < 2 {
		t.Errorf("at most %d handlers ran at once: the other keys' jobs did not run beside the hung one", watch.peak)
	}
}

// decisions records a stream sink runner's decisions by idempotency key.
type decisions struct {
	mu sync.Mutex
	by map[string][]sink.Outcome
}

func (d *decisions) Decided(_ context.Context, dec sink.Decision) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.by == nil {
		d.by = map[string][]sink.Outcome{}
	}
	d.by[dec.Stamp.Key] = append(d.by[dec.Stamp.Key], dec.Outcome)
}

func (d *decisions) of(key string) []sink.Outcome {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]sink.Outcome(nil), d.by[key]...)
}

// A zombie with many jobs in flight. Worker A runs eight jobs of one
// partition at once, each of which emitted an effect and stamped a write
// of its own when A is cut off from NATS past its TTL, as a paused process
// would be; B takes the partition over and runs every job. When A comes
// back, each of its eight handlers carries on and publishes its write
// stamped before the pause: a stream sink runner refuses every one of
// them as stale, A's held effects never leave, A commits nothing, and each
// job applies once, from B.
func TestZombieWithManyJobsInFlight(t *testing.T) {
	e := newEnv(t, 1, natstestListen()...)
	const inFlight = 8
	var bodies []string
	for k := range inFlight {
		for n := range 3 {
			bodies = append(bodies, fmt.Sprintf("z%d/%d", k, n))
		}
	}
	seqs := enqueueBodies(t, e, bodies)
	applied := newAppliedOrder()
	var dec decisions
	runSink(t, e, streamsink.Config{Handler: applied.handle, Verifier: e.bucket, Observer: &dec})

	px, _, jsA, bucketA := e.proxied(t)
	var (
		mu       sync.Mutex
		stamps   []leasehold.Stamp // A's writes stamped before the pause
		rawErrs  []error
		emitErrs []error
		blocked  = make(chan struct{}, inFlight)
		release  = make(chan struct{})
		wrote    sync.WaitGroup
	)
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	wrote.Add(inFlight)
	cfgA := e.config("a", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if err := j.Emit(ctx, j.Data); err != nil {
			return err
		}
		if _, n := splitBody(string(j.Data)); n != 0 {
			return nil
		}
		defer wrote.Done()
		s, err := j.NextStamp()
		if err != nil {
			return err
		}
		mu.Lock()
		stamps = append(stamps, s)
		mu.Unlock()
		blocked <- struct{}{}
		<-release // ignores ctx, as a paused process would
		msg := &nats.Msg{Subject: worker.OutputSubject(e.prefix, 0), Data: []byte("zombie"), Header: nats.Header{}}
		s.SetHeader(msg.Header)
		_, rawErr := jsA.PublishMsg(ctxFor(t, 30*time.Second), msg, jetstream.WithMsgID(s.Key))
		emitErr := j.Emit(ctx, []byte("late"))
		mu.Lock()
		rawErrs, emitErrs = append(rawErrs, rawErr), append(emitErrs, emitErr)
		mu.Unlock()
		return nil
	}))
	recA, recB := newRecorder(), newRecorder()
	cfgA.JetStream, cfgA.Bucket, cfgA.Observer = jsA, bucketA, recA
	cfgA.PartitionConcurrency = inFlight
	cfgA.Coordinator.TTL = time.Second
	cfgA.Coordinator.Margin = 100 * time.Millisecond
	cfgA.CommitEvery = time.Hour // nothing committed before the pause
	a := start(t, cfgA)
	t.Cleanup(unblock) // runs before a's stop

	for range inFlight {
		select {
		case <-blocked:
		case <-time.After(time.Minute):
			t.Fatal("A never had every key's first job in flight")
		}
	}
	px.Freeze()
	recA.waitFor(t, 30*time.Second, "A to see its lease lost", func() bool { return recA.count(kind(worker.EventPartitionLost)) > 0 })

	cfgB := e.config("b", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error { return j.Emit(ctx, j.Data) }))
	cfgB.Coordinator.TTL = time.Second
	cfgB.PartitionConcurrency = inFlight
	cfgB.Observer = recB
	b := start(t, cfgB)
	recB.waitFor(t, time.Minute, "every job applied", func() bool { return applied.count() == len(bodies) })

	px.Thaw()
	unblock()
	wrote.Wait()
	mu.Lock()
	late := append([]leasehold.Stamp(nil), stamps...)
	for i := range rawErrs {
		if rawErrs[i] != nil {
			t.Fatalf("A's raw write: %v", rawErrs[i])
		}
		if !errors.Is(emitErrs[i], leasehold.ErrLeaseLost) {
			t.Errorf("A's late emit: %v, want an error matching ErrLeaseLost", emitErrs[i])
		}
	}
	mu.Unlock()
	recB.waitFor(t, time.Minute, "the sink to decide A's late writes", func() bool {
		for _, s := range late {
			if len(dec.of(s.Key)) == 0 {
				return false
			}
		}
		return true
	})
	a.stop(t)
	b.stop(t)

	epochB := recB.all()[0].Lease.Epoch
	for _, s := range late {
		if s.Epoch >= epochB {
			t.Fatalf("A's write %s stamped at epoch %d, not below B's %d", s.Key, s.Epoch, epochB)
		}
		for _, o := range dec.of(s.Key) {
			if o != sink.Stale {
				t.Errorf("A's late write %s: %v, want %v", s.Key, o, sink.Stale)
			}
		}
	}
	for _, ev := range recA.all() {
		if ev.Kind == worker.EventProgressCommitted {
			t.Errorf("A committed progress %d", ev.Seq)
		}
	}
	k := &keyJobs{all: bodies, seqs: seqs}
	applied.check(t, k)
}
