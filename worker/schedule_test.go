package worker_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A delayed job is stored on its partition by the server's scheduler at its
// due time and not before (the server's own timestamp of the job says so,
// as does the handler's clock), and runs once, with the ID it was enqueued
// under, while jobs enqueued meanwhile run at once.
func TestDelayedJobRunsOnceAtItsTime(t *testing.T) {
	e := newEnv(t, 2)
	p := e.producer(t)
	ctx := ctxFor(t, 60*time.Second)

	type run struct {
		job   *worker.Job
		start time.Time
	}
	runs := make(chan run, 16)
	mux := worker.NewMux()
	worker.Handle(mux, "remind", func(ctx context.Context, j *worker.Job, m email) error {
		runs <- run{j, time.Now()}
		return j.Emit(ctx, []byte(m.To))
	})
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Observer = rec
	start(t, cfg)

	key := worker.WithKey([]byte("ann"))
	asked := time.Now().Add(2 * time.Second)
	delayed, err := worker.Enqueue(ctx, p, "remind", email{To: "later"}, worker.JobID("remind-ann"), worker.EnqueueAt(asked), key)
	if err != nil {
		t.Fatal(err)
	}
	if delayed.Due.Before(asked) || delayed.Due.Sub(asked) >= time.Second {
		t.Fatalf("due %v for a job asked for %v: want it rounded up to the second", delayed.Due, asked)
	}
	again, err := worker.Enqueue(ctx, p, "remind", email{To: "later"}, worker.JobID("remind-ann"), worker.EnqueueAt(asked), key)
	if err != nil || !again.Duplicate || again.Seq != delayed.Seq {
		t.Fatalf("the same delayed job again: %+v, %v; want a duplicate of sequence %d", again, err, delayed.Seq)
	}
	now, err := worker.Enqueue(ctx, p, "remind", email{To: "now"}, key)
	if err != nil {
		t.Fatal(err)
	}

	first := <-runs
	if first.job.Seq != now.Seq {
		t.Fatalf("the first job to run is %d (%s), want the immediate one, %d", first.job.Seq, first.job.Data, now.Seq)
	}
	var r run
	select {
	case r = <-runs:
	case <-ctx.Done():
		t.Fatal("the delayed job never ran")
	}
	j := r.job
	if j.Kind() != "remind" || string(j.Data) != `{"to":"later","subject":""}` || j.Partition != delayed.Partition {
		t.Fatalf("delayed job ran as kind %q, data %s, partition %d", j.Kind(), j.Data, j.Partition)
	}
	// Measured on nats-server v2.15.2: the job the scheduler stores has no
	// Nats-Msg-Id (the ID travels in Leasehold-Job-Id), and names its
	// schedule in Nats-Scheduler.
	t.Logf("fired job headers: Nats-Msg-Id %q, Nats-Scheduler %q, Nats-Schedule-Next %q",
		j.Header.Get("Nats-Msg-Id"), j.Header.Get("Nats-Scheduler"), j.Header.Get("Nats-Schedule-Next"))
	if j.Header.Get("Nats-Scheduler") != worker.ScheduleSubject(e.prefix, "remind-ann") {
		t.Fatalf("the fired job names its schedule %q", j.Header.Get("Nats-Scheduler"))
	}
	if j.ID != "remind-ann" {
		t.Fatalf("the delayed job's ID is %q, want remind-ann", j.ID)
	}
	if j.Enqueued.Before(delayed.Due) || r.start.Before(delayed.Due) {
		t.Fatalf("the delayed job was stored at %v (server time) and started at %v, before its due time %v", j.Enqueued, r.start, delayed.Due)
	}
	if j.Seq <= now.Seq {
		t.Fatalf("the delayed job has sequence %d, below the job enqueued after it (%d)", j.Seq, now.Seq)
	}
	t.Logf("due %v, stored by the server %v later, handler started %v later", delayed.Due.Format(time.RFC3339Nano), j.Enqueued.Sub(delayed.Due), r.start.Sub(delayed.Due))

	// Once: a job enqueued after it runs, and the delayed one never again.
	after, err := worker.Enqueue(ctx, p, "remind", email{To: "after"}, key)
	if err != nil {
		t.Fatal(err)
	}
	if r := <-runs; r.job.Seq != after.Seq {
		t.Fatalf("after the delayed job ran %d (%s), want %d", r.job.Seq, r.job.Data, after.Seq)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	if m, err := s.GetLastMsgForSubject(ctx, worker.ScheduleSubject(e.prefix, "remind-ann")); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Fatalf("the fired schedule is still stored: %v, %v", m, err)
	}
	if n := rec.count(kind(worker.EventJobStarted)); n != 3 {
		t.Fatalf("%d attempts for 3 jobs", n)
	}
}

// A job stream that cannot schedule says so when a delayed job is
// enqueued, and why; schedules are off unless asked for, and asking for
// them on a stream with a size limit fails at provisioning.
func TestDelayedJobNeedsSchedules(t *testing.T) {
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	ctx := ctxFor(t, 30*time.Second)
	err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "capped", Partitions: 1, MaxBytes: 1 << 20, Schedules: true})
	if !errors.Is(err, worker.ErrNoSchedules) {
		t.Fatalf("schedules asked for on a capped stream: %v", err)
	}
	t.Log(err)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "plain", Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	if s, err := js.Stream(ctx, worker.JobsStream("plain")); err != nil || s.CachedInfo().Config.AllowMsgSchedules || s.CachedInfo().Config.AllowRollup {
		t.Fatalf("a job stream provisioned without Schedules allows schedules or roll-ups (%v)", err)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "plain", Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Enqueue(ctx, nil, []byte("x"), worker.EnqueueIn(time.Second))
	if !errors.Is(err, worker.ErrNoSchedules) {
		t.Fatalf("delayed job on a capped stream: %v", err)
	}
	t.Log(err)
	if _, err := p.Enqueue(ctx, nil, []byte("x")); err != nil {
		t.Fatalf("an immediate job on the same stream: %v", err)
	}

	// An existing stream provisioned without schedules gets them when a
	// later ProvisionJobs asks for them.
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "old", Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "old", Partitions: 1, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, worker.JobsStream("old"))
	if err != nil || !s.CachedInfo().Config.AllowMsgSchedules {
		t.Fatalf("re-provisioned stream: schedules not enabled (%v)", err)
	}
}

// A periodic job fires once per tick across the fleet. Three workers
// register it (one schedule is stored, and registering again does not move
// it); the worker handling a tick freezes past its lease TTL, the others
// take the partition over, and the ticks go on: each tick is stored once,
// with a deterministic ID, and handled by a live holder.
func TestPeriodicJobFiresOncePerTick(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2, natstestListen()...)
	ctx := ctxFor(t, 2*time.Minute)
	tick := worker.Periodic{Name: "sweep", Kind: "sweep", Every: time.Second, Payload: map[string]int{"batch": 10}}

	var (
		mu       sync.Mutex
		ticks    []handledTick
		blocked  = make(chan struct{})
		release  = make(chan struct{})
		blockSeq uint64
	)
	handler := func(name string) worker.Handler {
		mux := worker.NewMux()
		worker.Handle(mux, "sweep", func(ctx context.Context, j *worker.Job, v map[string]int) error {
			if v["batch"] != 10 {
				return worker.Permanent(errors.New("payload lost"))
			}
			mu.Lock()
			ticks = append(ticks, handledTick{name, j.ID, j.Seq, j.Lease.Epoch})
			n := len(ticks)
			mu.Unlock()
			if name == "frozen" && n == 2 {
				mu.Lock()
				blockSeq = j.Seq
				mu.Unlock()
				close(blocked)
				<-release // ignores ctx, as a paused process would
			}
			return j.Emit(ctx, []byte(j.ID))
		})
		return mux
	}

	// The frozen worker connects through a proxy that can freeze it.
	px, _, jsF, bucketF := e.proxied(t)
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }

	recF := newRecorder()
	cfgF := e.config("frozen", handler("frozen"))
	cfgF.JetStream, cfgF.Bucket = jsF, bucketF
	cfgF.Coordinator.TTL = time.Second
	cfgF.Coordinator.Margin = 100 * time.Millisecond
	cfgF.Observer = recF
	start(t, cfgF)
	t.Cleanup(unblock)
	recF.waitFor(t, 30*time.Second, "the first worker to hold every partition", func() bool {
		return recF.count(kind(worker.EventPartitionReady)) == e.n
	})

	// Every worker registers the periodic job at start, concurrently.
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: e.n})
			if err == nil {
				err = p.Schedule(ctx, tick)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	sched, err := s.GetLastMsgForSubject(ctx, worker.PeriodicSubject(e.prefix, "sweep"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(worker.PeriodicSubject(e.prefix, "sweep")))
	if err != nil || info.State.Subjects[worker.PeriodicSubject(e.prefix, "sweep")] != 1 {
		t.Fatalf("schedules stored for one periodic job: %v (%v)", info.State.Subjects, err)
	}

	select {
	case <-blocked:
	case <-ctx.Done():
		t.Fatal("the first worker never reached its second tick")
	}
	px.Freeze()
	recF.waitFor(t, 30*time.Second, "the frozen worker's lease to be lost", func() bool {
		return recF.count(kind(worker.EventPartitionLost)) > 0
	})
	recs := []*recorder{newRecorder(), newRecorder()}
	for i, name := range []string{"b", "c"} {
		cfg := e.config(name, handler(name))
		cfg.Coordinator.TTL = time.Second
		cfg.Observer = recs[i]
		start(t, cfg)
	}
	// Registering again at start changes nothing.
	p := e.producer(t)
	if err := p.Schedule(ctx, tick); err != nil {
		t.Fatal(err)
	}
	if again, err := s.GetLastMsgForSubject(ctx, worker.PeriodicSubject(e.prefix, "sweep")); err != nil || again.Sequence != sched.Sequence {
		t.Fatalf("registering again stored a new schedule: %v (%v), was %d", again, err, sched.Sequence)
	}

	const want = 4 // ticks handled by the live workers after the take-over
	live := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, h := range ticks {
			if h.worker != "frozen" && h.seq > blockSeq {
				n++
			}
		}
		return n
	}
	recs[0].waitFor(t, time.Minute, "ticks after the take-over", func() bool { return live() >= want })
	px.Thaw()
	unblock()
	recF.waitFor(t, 30*time.Second, "the frozen worker's commit to be refused", func() bool {
		return recF.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventCommitFailed && errors.Is(ev.Err, leasehold.ErrLeaseLost)
		}) > 0 || recF.count(kind(worker.EventPartitionLost)) > 0
	})
	if err := p.Unschedule(ctx, "sweep"); err != nil {
		t.Fatal(err)
	}

	// The stream holds each tick once, a second apart, each with its own
	// deterministic ID.
	part := leasehold.PartitionFor([]byte("sweep"), e.n)
	stored := map[string]uint64{}
	var times []time.Time
	for _, m := range readStream(t, e.js, worker.JobsStream(e.prefix)) {
		if m.Subject() != worker.JobSubject(e.prefix, part) || m.Headers().Get("Nats-Scheduler") == "" {
			continue
		}
		md, _ := m.Metadata()
		h := &worker.Job{Header: m.Headers()}
		if h.Kind() != "sweep" {
			t.Fatalf("tick of kind %q", h.Kind())
		}
		times = append(times, md.Timestamp)
		stored[m.Headers().Get("Nats-Schedule-Next")] = md.Sequence.Stream
	}
	if len(stored) != len(times) {
		t.Fatalf("%d ticks stored under %d distinct next times: a tick fired twice", len(times), len(stored))
	}
	mu.Lock()
	defer mu.Unlock()
	bySeq := map[uint64][]handledTick{}
	ids := map[string]uint64{}
	for _, h := range ticks {
		bySeq[h.seq] = append(bySeq[h.seq], h)
		if seq, ok := ids[h.id]; ok && seq != h.seq {
			t.Fatalf("tick ID %s on two jobs, %d and %d", h.id, seq, h.seq)
		}
		ids[h.id] = h.seq
	}
	for _, seq := range stored {
		hs := bySeq[seq]
		if seq > blockSeq && len(hs) == 0 && seq < maxSeq(bySeq) {
			t.Errorf("tick %d was never handled", seq)
		}
		// A tick may run again after a take-over (at least once), but
		// never twice under one lease.
		epochs := map[leasehold.Epoch]bool{}
		for _, h := range hs {
			if epochs[h.epoch] {
				t.Errorf("tick %d handled twice under epoch %d: %v", seq, h.epoch, hs)
			}
			epochs[h.epoch] = true
		}
	}
	hs := bySeq[blockSeq]
	if len(hs) < 2 || hs[0].worker != "frozen" || hs[1].worker == "frozen" || hs[1].epoch <= hs[0].epoch || hs[0].id != hs[1].id {
		t.Errorf("the tick the frozen worker was in: %v; want it re-run by a live worker at a higher epoch under the same ID", hs)
	}
	t.Logf("%d ticks stored; handled: %v", len(times), ticks)
}

type handledTick struct {
	worker string
	id     string
	seq    uint64
	epoch  leasehold.Epoch
}

func maxSeq(m map[uint64][]handledTick) uint64 {
	var max uint64
	for s := range m {
		if s > max {
			max = s
		}
	}
	return max
}

// A cron schedule fires too (nats-server 2.14+), and periodic definitions
// the server would refuse are refused before they are sent.
func TestPeriodicCronAndInvalidDefinitions(t *testing.T) {
	for _, pj := range []worker.Periodic{
		{Kind: "x"},
		{Kind: "x", Every: time.Second, Cron: "@hourly"},
		{Kind: "x", Every: 500 * time.Millisecond},
		{Kind: "x", Every: time.Minute, TimeZone: "Europe/Paris"},
		{Kind: "bad kind", Every: time.Minute},
	} {
		if err := pj.Validate(); err == nil {
			t.Errorf("%+v is valid", pj)
		}
	}
	e := newEnv(t, 1)
	ctx := ctxFor(t, 30*time.Second)
	ticks := make(chan *worker.Job, 8)
	mux := worker.NewMux()
	worker.Handle(mux, "cron", func(ctx context.Context, j *worker.Job, v *struct{}) error {
		ticks <- j
		return nil
	})
	start(t, e.config("w", mux))
	p := e.producer(t)
	if err := p.Schedule(ctx, worker.Periodic{Name: "each-second", Kind: "cron", Cron: "* * * * * *", TimeZone: "UTC"}); err != nil {
		t.Fatal(err)
	}
	var got []*worker.Job
	for len(got) < 2 {
		select {
		case j := <-ticks:
			got = append(got, j)
		case <-ctx.Done():
			t.Fatalf("%d cron ticks within 30s", len(got))
		}
	}
	first, second := got[0], got[1]
	if err := p.Unschedule(ctx, "each-second"); err != nil {
		t.Fatal(err)
	}
	if first.ID == second.ID || !strings.HasPrefix(first.ID, "periodic/each-second@next=") {
		t.Fatalf("cron ticks with IDs %q and %q", first.ID, second.ID)
	}
}
