package worker_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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

// keyJobs enqueues jobs of keys k0 .. k<keys-1> in turn, each job's body
// "<key>/<n>": its key, and its place among its key's jobs. next holds
// each key's next place, so that batches continue the count.
type keyJobs struct {
	keys int
	next map[string]int
	seqs map[string]uint64 // body -> sequence
	all  []string          // bodies, in the order enqueued
}

func newKeyJobs(keys int) *keyJobs {
	return &keyJobs{keys: keys, next: map[string]int{}, seqs: map[string]uint64{}}
}

// enqueue stores count more jobs through Producer.Enqueue (by key).
func (k *keyJobs) enqueue(t *testing.T, e *env, count int) {
	t.Helper()
	p := e.producer(t)
	ctx := ctxFor(t, time.Minute)
	b := p.Batch()
	var bodies []string
	for i := range count {
		key := fmt.Sprintf("k%d", i%k.keys)
		body := fmt.Sprintf("%s/%d", key, k.next[key])
		k.next[key]++
		if err := b.Enqueue(ctx, []byte(key), []byte(body)); err != nil {
			t.Fatal(err)
		}
		bodies = append(bodies, body)
	}
	res, err := b.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		k.seqs[bodies[i]] = r.Seq
	}
	k.all = append(k.all, bodies...)
}

func splitBody(body string) (string, int) {
	key, n, _ := strings.Cut(body, "/")
	i, _ := strconv.Atoi(n)
	return key, i
}

// keyWatch checks, inside the handlers, that a key's jobs run one at a
// time under a lease, and that a job starts only once every earlier job of
// its key has succeeded (under this lease or an earlier one).
type keyWatch struct {
	mu        sync.Mutex
	succeeded map[string]map[int]bool
	running   map[string]int // "<epoch> <key>" -> jobs of the key running under the epoch
	peak      int            // handlers running at once, at the most
	now       int
	errs      []string
}

func newKeyWatch() *keyWatch {
	return &keyWatch{succeeded: map[string]map[int]bool{}, running: map[string]int{}}
}

func (w *keyWatch) start(j *worker.Job) {
	key, n := splitBody(string(j.Data))
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := range n {
		if !w.succeeded[key][i] {
			w.errs = append(w.errs, fmt.Sprintf("%s (job %d, epoch %d) started before %s/%d succeeded", j.Data, j.Seq, j.Lease.Epoch, key, i))
			break
		}
	}
	lk := j.Lease.Epoch.String() + " " + key
	if w.running[lk]++; w.running[lk] > 1 {
		w.errs = append(w.errs, fmt.Sprintf("%s (job %d) started under epoch %d while another job of %s ran", j.Data, j.Seq, j.Lease.Epoch, key))
	}
	w.now++
	w.peak = max(w.peak, w.now)
}

func (w *keyWatch) end(j *worker.Job, err error) {
	key, n := splitBody(string(j.Data))
	w.mu.Lock()
	defer w.mu.Unlock()
	w.running[j.Lease.Epoch.String()+" "+key]--
	w.now--
	if err == nil {
		if w.succeeded[key] == nil {
			w.succeeded[key] = map[int]bool{}
		}
		w.succeeded[key][n] = true
	}
}

func (w *keyWatch) check(t *testing.T) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.errs[:min(len(w.errs), 10)] {
		t.Error(e)
	}
}

// appliedOrder records the bodies a stream sink runner applied, in the
// order it first applied their idempotency keys. A sink's handler must be
// idempotent by key: a job that a successor runs again because its
// predecessor applied its effect but did not commit it is handed over
// again under the same key, and counts once.
type appliedOrder struct {
	mu     sync.Mutex
	bodies []string
	keys   map[string]bool
	keyOf  map[string]string // body -> the key it applied under
	again  int               // deliveries of a key applied before
	errs   []string
	notify chan struct{}
}

func newAppliedOrder() *appliedOrder {
	return &appliedOrder{keys: map[string]bool{}, keyOf: map[string]string{}, notify: make(chan struct{}, 1)}
}

func (a *appliedOrder) handle(_ context.Context, e sink.Effect) error {
	a.mu.Lock()
	if k, ok := a.keyOf[string(e.Data)]; ok && k != e.Stamp.Key {
		a.errs = append(a.errs, fmt.Sprintf("%s applied under key %s and under key %s", e.Data, k, e.Stamp.Key))
	}
	a.keyOf[string(e.Data)] = e.Stamp.Key
	if a.keys[e.Stamp.Key] {
		a.again++
	} else {
		a.keys[e.Stamp.Key] = true
		a.bodies = append(a.bodies, string(e.Data))
	}
	a.mu.Unlock()
	select {
	case a.notify <- struct{}{}:
	default:
	}
	return nil
}

func (a *appliedOrder) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.bodies)
}

// check requires every job of k applied, each key's in the order
// enqueued, and no job applied under two idempotency keys.
func (a *appliedOrder) check(t *testing.T, k *keyJobs) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, e := range a.errs[:min(len(a.errs), 10)] {
		t.Error(e)
	}
	next := map[string]int{}
	bad := 0
	for _, b := range a.bodies {
		key, n := splitBody(b)
		if n != next[key] && bad < 10 {
			bad++
			t.Errorf("applied %s after %s/%d: each key's jobs apply once each, in order", b, key, next[key]-1)
		}
		next[key] = max(next[key], n+1)
	}
	if len(a.bodies) != len(k.all) {
		t.Errorf("applied %d effects for %d jobs", len(a.bodies), len(k.all))
	}
	t.Logf("%d jobs applied; %d deliveries again of keys applied before (jobs re-run after the fail-over)", len(a.bodies), a.again)
}

// startSink runs a stream sink runner on the env's effect log.
func startSink(t *testing.T, e *env, h func(context.Context, sink.Effect) error) *streamsink.Runner {
	t.Helper()
	return runSink(t, e, streamsink.Config{Handler: h, Progress: e.bucket})
}

// The jobs of one key run one after another in stream order, and their
// effects apply in that order, while other keys run beside them: across a
// rewind (one job's effect refused until the test removes what is in the
// way), a graceful hand-off (a second worker joins) and a fail-over (the
// first worker is cut off past its TTL, as a paused process would be, and
// carries on as a zombie when it comes back). A stream sink runner applies
// the effect log.
func TestKeyOrder(t *testing.T) {
	e := newEnv(t, 2, natstestListen()...)
	ctx := ctxFor(t, 3*time.Minute)
	dest, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "REWIND", Subjects: []string{"rewind.>"}, Storage: jetstream.FileStorage,
		MaxMsgsPerSubject: 1, Discard: jetstream.DiscardNew, DiscardNewPerSubject: true, MaxMsgs: -1, MaxBytes: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	blocker, err := e.js.Publish(ctx, "rewind.x", []byte("in the way"))
	if err != nil {
		t.Fatal(err)
	}
	applied := newAppliedOrder()
	startSink(t, e, applied.handle)

	watch := newKeyWatch()
	const rewindAt = "k5/10"
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) (err error) {
		watch.start(j)
		defer func() { watch.end(j, err) }()
		// Work of a varying length, so that jobs complete out of order.
		time.Sleep(time.Duration(j.Seq%4) * time.Millisecond)
		if err := j.Emit(ctx, j.Data); err != nil {
			return err
		}
		if string(j.Data) == rewindAt {
			// Refused until the test removes the blocker: the runner
			// rewinds.
			return j.Publish(ctx, "rewind.x", j.Data)
		}
		return nil
	})

	px, _, jsA, bucketA := e.proxied(t)
	recA, recB := newRecorder(), newRecorder()
	cfgA := e.config("a", h)
	cfgA.JetStream, cfgA.Bucket, cfgA.Observer = jsA, bucketA, recA
	cfgA.PartitionConcurrency = 8
	cfgA.MaxAttempts = 1_000_000 // the refusal is not the job's fault
	a := start(t, cfgA)

	k := newKeyJobs(12)
	k.enqueue(t, e, 240)
	rec := func(ev worker.Event) bool {
		var ee *worker.EffectError
		return ev.Kind == worker.EventJobFailed && ev.Seq == k.seqs[rewindAt] && errors.As(ev.Err, &ee) && ee.Subject == "rewind.x"
	}
	recA.waitFor(t, time.Minute, "the refused effect", func() bool { return recA.count(rec) > 0 })
	if err := dest.DeleteMsg(ctx, blocker.Sequence); err != nil {
		t.Fatal(err)
	}

	// A hand-off: b joins, and a gives it a partition.
	cfgB := e.config("b", h)
	cfgB.Observer = recB
	cfgB.PartitionConcurrency = 8
	b := start(t, cfgB)
	recB.waitFor(t, time.Minute, "b to take a partition", func() bool { return len(b.w.Held()) == 1 })
	k.enqueue(t, e, 240)

	// A fail-over: a is cut off, and b takes its partition when the lease
	// expires.
	px.Freeze()
	recB.waitFor(t, time.Minute, "b to take both partitions", func() bool { return len(b.w.Held()) == 2 })
	k.enqueue(t, e, 240)
	recB.waitFor(t, 2*time.Minute, "every job's effect applied", func() bool { return applied.count() >= len(k.all) })
	px.Thaw()
	a.stop(t)
	b.stop(t)

	if n := recA.count(rec); n == 0 {
		t.Error("the rewind never happened")
	}
	if recA.count(kind(worker.EventPartitionRevoked)) == 0 {
		t.Error("a handed no partition off")
	}
	watch.check(t)
	applied.check(t, k)
	if watch.peak < 2 {
		t.Errorf("at most %d handlers ran at once: nothing ran side by side", watch.peak)
	}
}

// A job with no order key (EnqueueTo, or an earlier release's producer) is
// ordered by partition: it starts once every earlier job has returned, and
// no later job starts before it returns; keyed jobs run side by side.
func TestJobsWithoutOrderKeyRunInPartitionOrder(t *testing.T) {
	e := newEnv(t, 1)
	var mu sync.Mutex
	var trail []string // "+<seq>" at start, "-<seq>" at return
	var now, peak int
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		trail = append(trail, fmt.Sprintf("+%d", j.Seq))
		now++
		peak = max(peak, now)
		mu.Unlock()
		time.Sleep(time.Duration(j.Seq%3) * time.Millisecond)
		mu.Lock()
		trail = append(trail, fmt.Sprintf("-%d", j.Seq))
		now--
		mu.Unlock()
		return nil
	}))
	cfg.PartitionConcurrency = 8
	cfg.Observer = rec
	p := e.producer(t)
	ctx := ctxFor(t, time.Minute)
	b := p.Batch()
	unkeyed := map[uint64]bool{}
	var order []bool // per job in order: keyed
	for i := range 120 {
		if i%10 == 5 {
			if err := b.EnqueueTo(ctx, 0, []byte("plain")); err != nil {
				t.Fatal(err)
			}
			order = append(order, false)
			continue
		}
		if err := b.Enqueue(ctx, []byte(fmt.Sprintf("key-%d", i)), []byte("keyed")); err != nil {
			t.Fatal(err)
		}
		order = append(order, true)
	}
	res, err := b.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if !order[i] {
			unkeyed[r.Seq] = true
		}
	}
	// A malformed order key, as a hand-published job could carry: ordered
	// by partition too.
	forged := &nats.Msg{Subject: worker.JobSubject(e.prefix, 0), Data: []byte("forged"), Header: nats.Header{leasehold.HeaderOrderKey: {"NOT-HEX"}}}
	ack, err := e.js.PublishMsg(ctx, forged)
	if err != nil {
		t.Fatal(err)
	}
	unkeyed[ack.Sequence] = true
	total := len(res) + 1
	start(t, cfg)
	rec.waitFor(t, time.Minute, "every job", func() bool { return rec.count(kind(worker.EventJobFinished)) >= total })

	mu.Lock()
	defer mu.Unlock()
	started, returned := map[uint64]int{}, map[uint64]int{}
	for i, s := range trail {
		seq, _ := strconv.ParseUint(s[1:], 10, 64)
		if s[0] == '+' {
			started[seq] = i
		} else {
			returned[seq] = i
		}
	}
	for u := range unkeyed {
		for seq, at := range started {
			switch {
			case seq < u && returned[seq] > started[u]:
				t.Errorf("job %d, with no order key, started before the earlier job %d returned", u, seq)
			case seq > u && at < returned[u]:
				t.Errorf("job %d started before job %d, with no order key and earlier, returned", seq, u)
			}
		}
	}
	if peak < 2 {
		t.Errorf("at most %d handlers ran at once: the keyed jobs ran one at a time", peak)
	}
}
