package worker_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A handler that panics is recovered; the panic, with its stack, counts as
// a failed attempt and the job runs again.
func TestPanicCountsAsFailedAttempt(t *testing.T) {
	e := newEnv(t, 1)
	enq := e.enqueue(t, 0, 5)
	target := enq[2].Seq
	var runs runLog
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		if j.Seq == target && j.Attempt == 1 {
			panic("boom")
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.Observer = rec
	cfg.Order = worker.OrderPartition // the runs' order is asserted
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "every job", func() bool { return rec.count(kind(worker.EventJobFinished)) == len(enq) })

	var pe *worker.PanicError
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobFailed {
			if ev.Seq != target || ev.Attempt != 1 || !errors.As(ev.Err, &pe) {
				t.Fatalf("failure event %+v", ev)
			}
		}
	}
	if pe == nil || pe.Value != "boom" || !strings.Contains(string(pe.Stack), "failure_test.go") {
		t.Fatalf("panic error %v does not carry the value and the stack", pe)
	}
	var order []uint64
	for _, r := range runs.all() {
		order = append(order, r.Seq)
	}
	want := []uint64{enq[0].Seq, enq[1].Seq, target, target, enq[3].Seq, enq[4].Seq}
	if !equal(order, want) {
		t.Fatalf("ran %v, want %v", order, want)
	}
}

// A job that keeps failing is retried MaxAttempts times, then dead-lettered
// with its data, its headers and the error; the partition carries on after
// it, and progress moves past it.
func TestFailingJobIsRetriedThenDeadLettered(t *testing.T) {
	e := newEnv(t, 1)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	var enq []worker.Enqueued
	for i := range 4 {
		q, err := p.EnqueueTo(ctx, 0, []byte("job-"+strconv.Itoa(i)), worker.JobID("id-"+strconv.Itoa(i)),
			worker.WithHeader(nats.Header{"X-Order": []string{strconv.Itoa(i)}}))
		if err != nil {
			t.Fatal(err)
		}
		enq = append(enq, q)
	}
	var attempts atomic.Int64
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if string(j.Data) == "job-1" {
			attempts.Add(1)
			return errors.New("the payment service said no")
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.MaxAttempts = 3
	cfg.Observer = rec
	start(t, cfg)
	rec.waitCommitted(t, 30*time.Second, enq[3].Seq)
	if n := attempts.Load(); n != 3 {
		t.Fatalf("the failing job ran %d times, want 3", n)
	}
	if n := rec.count(kind(worker.EventJobFailed)); n != 3 {
		t.Fatalf("%d failure events, want 3", n)
	}
	if n := rec.count(kind(worker.EventJobDeadLettered)); n != 1 {
		t.Fatalf("%d dead-letter events, want 1", n)
	}
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dlq))
	}
	m := dlq[0]
	h := m.Headers()
	st, _ := leasehold.StampFromHeader(h)
	lease := rec.all()[0].Lease
	checks := map[string]string{
		"subject":                        m.Subject(),
		"data":                           string(m.Data()),
		worker.HeaderAttempts:            h.Get(worker.HeaderAttempts),
		worker.HeaderSubject:             h.Get(worker.HeaderSubject),
		worker.HeaderSeq:                 h.Get(worker.HeaderSeq),
		worker.HeaderJobID:               h.Get(worker.HeaderJobID),
		"X-Order":                        h.Get("X-Order"),
		leasehold.HeaderEpoch:            st.Epoch.String(),
		leasehold.HeaderScope:            st.Scope,
		leasehold.HeaderAcquisition:      st.Acquisition,
		leasehold.HeaderKey:              st.Key,
		leasehold.HeaderWorker:           st.Worker,
		"Nats-Msg-Id is key@epoch~nonce": strconv.FormatBool(strings.HasPrefix(h.Get("Nats-Msg-Id"), worker.DeadLetterKey(e.prefix, 0, enq[1].Seq)+"@"+lease.Epoch.String()+"~") && len(h.Get("Nats-Msg-Id")) == len(worker.MessageID(lease.Stamp(worker.DeadLetterKey(e.prefix, 0, enq[1].Seq)), "0123456789abcdef"))),
		"error mentions reason":          strconv.FormatBool(strings.Contains(h.Get(worker.HeaderError), "the payment service said no")),
	}
	want := map[string]string{
		"subject":                        worker.DLQSubject(e.prefix, 0),
		"data":                           "job-1",
		worker.HeaderAttempts:            "3",
		worker.HeaderSubject:             worker.JobSubject(e.prefix, 0),
		worker.HeaderSeq:                 strconv.FormatUint(enq[1].Seq, 10),
		worker.HeaderJobID:               "id-1",
		"X-Order":                        "1",
		leasehold.HeaderEpoch:            lease.Epoch.String(),
		leasehold.HeaderScope:            e.prefix,
		leasehold.HeaderAcquisition:      lease.Acquisition,
		leasehold.HeaderKey:              worker.DeadLetterKey(e.prefix, 0, enq[1].Seq),
		leasehold.HeaderWorker:           "w",
		"Nats-Msg-Id is key@epoch~nonce": "true",
		"error mentions reason":          "true",
	}
	for k, v := range want {
		if checks[k] != v {
			t.Errorf("dead letter %s = %q, want %q", k, checks[k], v)
		}
	}
	if got := len(readStream(t, e.js, worker.EffectsStream(e.prefix))); got != 1+3 {
		t.Errorf("%d messages on the output, want a barrier and 3 effects", got)
	}
}

type order struct {
	ID    string `json:"id"`
	Total int    `json:"total"`
}

// A payload that does not decode is dead-lettered on its first attempt,
// not retried: no retry can fix it.
func TestMalformedJobIsDeadLetteredAtOnce(t *testing.T) {
	e := newEnv(t, 1)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	for _, body := range []string{`{"id":"a","total":3}`, `{"id":"b","total":`, `{"id":"c","total":5}`} {
		if _, err := p.EnqueueTo(ctx, 0, []byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	var (
		mu  sync.Mutex
		got []string
	)
	rec := newRecorder()
	cfg := e.config("w", worker.JSON(func(ctx context.Context, j *worker.Job, o order) error {
		mu.Lock()
		got = append(got, o.ID)
		mu.Unlock()
		return nil
	}))
	cfg.Observer = rec
	start(t, cfg)
	// A job's finished event comes after its handler has returned, so two
	// of them mean both good jobs are in got; a count kept by the handler
	// itself could be read between its increment and the append.
	rec.waitFor(t, 30*time.Second, "the dead letter and the good jobs", func() bool {
		return rec.count(kind(worker.EventJobDeadLettered)) == 1 && rec.count(kind(worker.EventJobFinished)) == 2
	})
	if n := rec.count(kind(worker.EventJobFailed)); n != 1 {
		t.Fatalf("%d failed attempts, want 1", n)
	}
	// The event comes once the dead letter is stored.
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 {
		t.Fatalf("%d dead letters", len(dlq))
	}
	h := dlq[0].Headers()
	if h.Get(worker.HeaderAttempts) != "1" || !strings.Contains(h.Get(worker.HeaderError), "is not a JSON") {
		t.Fatalf("dead letter headers %v", h)
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(got, ",") != "a,c" {
		t.Fatalf("decoded %v", got)
	}
}

// EventJobDeadLettered means the dead letter is stored. While the
// dead-letter stream is missing, every try to store it is refused: the
// partition goes back to the job, no event comes and progress stays
// before it. Once the stream is back, the next try is stored, and the
// event comes with it.
func TestDeadLetterEventWaitsUntilItIsStored(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return worker.Permanent(errors.New("this job can never succeed"))
	}))
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the partition ready", func() bool { return rec.count(kind(worker.EventPartitionReady)) > 0 })
	if err := e.js.DeleteStream(ctx, worker.DLQStream(e.prefix)); err != nil {
		t.Fatal(err)
	}
	q, err := e.producer(t).EnqueueTo(ctx, 0, []byte("doomed"))
	if err != nil {
		t.Fatal(err)
	}
	// The handler's failure, then one for each refused dead letter.
	rec.waitFor(t, 30*time.Second, "a dead letter refused", func() bool {
		return rec.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventJobFailed && ev.Seq == q.Seq && errors.Is(ev.Err, jetstream.ErrNoStreamResponse)
		}) >= 2
	})
	// Two tries refused (the partition ran the job again each time), so
	// nothing may say the job is dead-lettered.
	if n := rec.count(kind(worker.EventJobDeadLettered)); n != 0 {
		t.Fatalf("%d dead-letter events while the dead-letter stream is missing", n)
	}
	if n := rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventProgressCommitted && ev.Seq >= q.Seq }); n != 0 {
		t.Fatalf("progress committed past a job whose dead letter is not stored")
	}
	if err := worker.ProvisionJobs(ctx, e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: e.n, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, 30*time.Second, "the dead-letter event", func() bool {
		return rec.count(kind(worker.EventJobDeadLettered)) > 0
	})
	if n := rec.count(kind(worker.EventJobDeadLettered)); n != 1 {
		t.Fatalf("%d dead-letter events, want 1", n)
	}
	if dlq := readStream(t, e.js, worker.DLQStream(e.prefix)); len(dlq) != 1 || dlq[0].Headers().Get(worker.HeaderSeq) != strconv.FormatUint(q.Seq, 10) {
		t.Fatalf("%d dead letters after the event, want the job's", len(dlq))
	}
	rec.waitFor(t, 30*time.Second, "progress past the job", func() bool {
		return rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventProgressCommitted && ev.Seq >= q.Seq }) > 0
	})
}

// A handler error matching ErrStaleEpoch stops the partition: the job is
// not retried and nothing is committed until the partition reads itself
// again. When the lease outlives the refusal (here nobody took over), the
// partition is read again from its progress.
func TestStaleEpochStopsThePartition(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	enq := e.enqueue(t, 0, 3)
	var refused atomic.Bool
	var runs runLog
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		if j.Seq == enq[1].Seq && refused.CompareAndSwap(false, true) {
			return &leasehold.StaleEpochError{Partition: j.Partition, Epoch: j.Lease.Epoch, Max: j.Lease.Epoch + 1}
		}
		return nil
	}))
	cfg.CommitEvery = time.Hour
	// The partition reads itself again only once its lease has outlived
	// the refusal by two TTLs, and the test waits that out: the lease must
	// stay alive for it. A 1s TTL (renewals every 333ms, each given 166ms)
	// is lost to a stall of a few hundred milliseconds on a busy machine,
	// and the test then sees a loss instead of the rewind. A 10s TTL would
	// cost 20s of waiting; 3s renewed every 250ms, each renewal given a
	// second, survives stalls of over 2s for 6s of waiting.
	cfg.Coordinator.TTL = 3 * time.Second
	cfg.Coordinator.RenewEvery = 250 * time.Millisecond
	cfg.Coordinator.RequestTimeout = time.Second
	cfg.Observer = rec
	cfg.Order = worker.OrderPartition // the runs' order is asserted
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the partition to resume and finish", func() bool {
		return rec.count(kind(worker.EventPartitionStopped)) == 1 && rec.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventJobFinished && ev.Seq == enq[2].Seq
		}) > 0
	})
	// Nothing past the refused job is committed before the partition
	// reads itself again (its first job started after the stop), and
	// nothing at all while it is stopped. A partition that has done all it
	// read commits at once, so job 0 may be committed before the refusal.
	var committed uint64
	stopped, resumed := false, false
	for _, ev := range rec.all() {
		switch {
		case ev.Kind == worker.EventPartitionStopped:
			stopped = true
		case ev.Kind == worker.EventJobStarted && stopped:
			resumed = true
		case ev.Kind == worker.EventProgressCommitted && !resumed:
			if stopped || ev.Seq >= enq[1].Seq {
				t.Fatalf("progress %d committed before the partition read itself again (stopped: %v)", ev.Seq, stopped)
			}
			committed = ev.Seq
		}
	}
	var order []uint64
	for _, r := range runs.all() {
		order = append(order, r.Seq)
	}
	// Job 0 ran, job 1 was refused; on resuming from the committed
	// progress (none, or job 0), the jobs after it ran.
	want := []uint64{enq[0].Seq, enq[1].Seq, enq[0].Seq, enq[1].Seq, enq[2].Seq}
	if committed == enq[0].Seq {
		want = []uint64{enq[0].Seq, enq[1].Seq, enq[1].Seq, enq[2].Seq}
	}
	if !equal(order, want) {
		t.Fatalf("ran %v, want %v", order, want)
	}
}

func equal(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// An effect the stream refuses fails its job: the partition is read again
// from that job (later jobs run again with the same keys, which sinks
// dedupe; each attempt's message IDs are its own, so the log keeps each
// attempt's effects once), and after MaxAttempts the job is dead-lettered.
func TestRefusedEffectFailsTheJob(t *testing.T) {
	e := newEnv(t, 1)
	if _, err := e.js.CreateStream(ctxFor(t, 10*time.Second), jetstream.StreamConfig{
		Name: "small", Subjects: []string{"small.>"}, MaxMsgSize: 64,
	}); err != nil {
		t.Fatal(err)
	}
	enq := e.enqueue(t, 0, 6)
	bad := enq[2].Seq
	var runs runLog
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		if j.Seq == bad {
			if err := j.Publish(ctx, "small.x", make([]byte, 1000)); err != nil {
				return err
			}
		}
		return j.Emit(ctx, j.Data)
	}))
	cfg.MaxAttempts = 3
	cfg.Observer = rec
	start(t, cfg)
	rec.waitCommitted(t, 30*time.Second, enq[5].Seq)
	n := 0
	for _, r := range runs.all() {
		if r.Seq == bad {
			n++
			if r.Attempt != n {
				t.Errorf("run %d of the failing job was attempt %d", n, r.Attempt)
			}
		}
	}
	if n != 3 {
		t.Fatalf("the job with the refused effect ran %d times, want 3", n)
	}
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 || !strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "small.x") || dlq[0].Headers().Get(worker.HeaderAttempts) != "3" {
		t.Fatalf("dead letters: %d, first %v", len(dlq), dlq)
	}
	keys, ids := map[string]bool{}, map[string]bool{}
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		id := m.Headers().Get("Nats-Msg-Id")
		if ids[id] {
			t.Fatalf("message %s stored twice", id)
		}
		ids[id] = true
		keys[keyOf(m.Headers())] = true
	}
	for _, q := range enq {
		if q.Seq != bad && !keys[leasehold.EffectKey(e.prefix, 0, q.Seq, 0)] {
			t.Errorf("job %d has no effect", q.Seq)
		}
	}
}
