package worker_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// deadLetters reads the dead letters of e's job stream: its dead-letter
// stream but the records (see worker.Record).
func deadLetters(t testing.TB, e *env) []jetstream.Msg {
	t.Helper()
	var out []jetstream.Msg
	for _, m := range readStream(t, e.js, worker.DLQStream(e.prefix)) {
		if !worker.IsRecordSubject(e.prefix, m.Subject()) {
			out = append(out, m)
		}
	}
	return out
}

// A job that ages out of the job stream before its partition reaches it
// never runs. Before the worker gets there its status says removed unrun;
// the worker, handed the next job, finds the gap and records it before its
// progress passes it, and the status still says removed unrun, never
// done. It used to say done once progress had passed the job.
func TestAgedOutJobIsRemovedUnrun(t *testing.T) {
	srv := natstest.Start(t)
	e := &env{srv: srv, prefix: "aged", n: 1}
	e.js = srv.JetStream(t)
	ctx := ctxFor(t, time.Minute)
	if err := worker.ProvisionJobs(ctx, e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: 1, MaxAge: time.Second, Duplicates: time.Second}); err != nil {
		t.Fatal(err)
	}
	e.bucket = e.provisionBucket(t)
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: 1, Bucket: e.bucket})
	if err != nil {
		t.Fatal(err)
	}
	lost, err := p.EnqueueTo(ctx, 0, []byte("lost"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	for {
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.FirstSeq > lost.Seq {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the job never aged out")
		case <-time.After(50 * time.Millisecond):
		}
	}
	// Keep the next job until the worker has it.
	sc := s.CachedInfo().Config
	sc.MaxAge = time.Hour
	if _, err := e.js.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
	if st, err := p.Status(ctx, lost); err != nil || st.State != worker.JobRemovedUnrun {
		t.Errorf("status of a job aged out before a worker came: %+v, %v; want removed unrun", st, err)
	}
	next, err := p.EnqueueTo(ctx, 0, []byte("next"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var ran []string
	start(t, e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error {
		mu.Lock()
		ran = append(ran, string(j.Data))
		mu.Unlock()
		return nil
	})))
	sts, err := p.Wait(ctx, next, lost)
	if err != nil {
		t.Fatal(err)
	}
	if sts[0].State != worker.JobDone || sts[1].State != worker.JobRemovedUnrun {
		t.Errorf("after the worker passed the aged-out job: %+v; want the next done and the aged-out one removed unrun", sts)
	}
	if st, err := p.Status(ctx, lost); err != nil || st.State != worker.JobRemovedUnrun || st.Progress < lost.Seq || !strings.Contains(st.Detail, "aged out") {
		t.Errorf("status of the aged-out job behind the progress: %+v, %v; want removed unrun", st, err)
	}
	mu.Lock()
	if len(ran) != 1 || ran[0] != "next" {
		t.Errorf("handlers ran for %v", ran)
	}
	mu.Unlock()
	var recs []worker.Record
	for _, m := range readStream(t, e.js, worker.DLQStream(e.prefix)) {
		r, err := worker.ParseRecord(e.prefix, m.Subject(), m.Data())
		if err != nil {
			t.Fatalf("the dead-letter stream holds %s: %v", m.Subject(), err)
		}
		recs = append(recs, r)
	}
	if len(recs) != 1 || recs[0].Kind != worker.RecordRemoved || recs[0].From != lost.Seq || recs[0].To != next.Seq-1 {
		t.Errorf("records %+v; want one of the removed range %d to %d", recs, lost.Seq, next.Seq-1)
	}
}

// Records are read only for jobs the partition's progress has passed, and
// only where they hold: a forged purge of a pending job leaves it pending;
// a record that names a dead letter stored after it, or one still there
// (forged, or our own tool's that stopped before the delete), or a replay
// that is not the dead letter's, changes nothing.
func TestForgedRecordsDoNotDecideStatus(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	p, err := worker.NewProducer(e.js, worker.ProducerConfig{Prefix: e.prefix, Partitions: 1, Bucket: e.bucket})
	if err != nil {
		t.Fatal(err)
	}
	ok, err := p.EnqueueTo(ctx, 0, []byte("ok"))
	if err != nil {
		t.Fatal(err)
	}
	bad, err := p.EnqueueTo(ctx, 0, []byte("bad"))
	if err != nil {
		t.Fatal(err)
	}
	origin := func(e worker.Enqueued) string { return leasehold.OriginOf("jobs", e.Partition, e.Seq).String() }
	forge := func(r worker.Record) {
		t.Helper()
		if _, err := worker.StoreRecord(ctx, e.js, e.prefix, r); err != nil {
			t.Fatal(err)
		}
	}
	status := func(ref worker.Enqueued) worker.JobStatus {
		t.Helper()
		st, err := p.Status(ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	// Dead-letter stream sequence 1: a purge of the pending job naming a
	// dead letter to come.
	forge(worker.Record{Kind: worker.RecordPurged, Partition: 0, Seq: ok.Seq, Origin: origin(ok), DeadLetter: 5, DeadLetterTime: time.Now()})
	if st := status(ok); st.State != worker.JobPending {
		t.Errorf("a pending job with a forged purge record: %+v; want pending", st)
	}
	cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error {
		if string(j.Data) == "bad" {
			return errors.New("no")
		}
		return nil
	}))
	cfg.MaxAttempts = 1
	start(t, cfg)
	sts, err := p.Wait(ctx, ok, bad) // bad's dead letter: sequence 2
	if err != nil {
		t.Fatal(err)
	}
	if sts[0].State != worker.JobDone || sts[1].State != worker.JobDeadLettered || sts[1].DeadLetter != 2 {
		t.Fatalf("after the worker: %+v", sts)
	}
	// 3: a purge of bad's dead letter, which is still there (as our own
	// tool leaves it when it stops between the record and the delete).
	forge(worker.Record{Kind: worker.RecordPurged, Partition: 0, Seq: bad.Seq, Origin: origin(bad), DeadLetter: 2, DeadLetterTime: time.Now().Add(-time.Second)})
	// 4, deleted: a dead letter gone.
	ack, err := e.js.PublishMsg(ctx, nats.NewMsg(worker.DLQSubject(e.prefix, 0)))
	if err != nil {
		t.Fatal(err)
	}
	dlq, err := e.js.Stream(ctx, worker.DLQStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	if err := dlq.DeleteMsg(ctx, ack.Sequence); err != nil {
		t.Fatal(err)
	}
	// 5: a replay of the gone dead letter as a job that is no replay of it.
	forge(worker.Record{Kind: worker.RecordReplayed, Partition: 0, Seq: ok.Seq, Origin: origin(ok), DeadLetter: ack.Sequence, DeadLetterTime: time.Now().Add(-time.Second), As: bad.Ref()})
	if st := status(ok); st.State != worker.JobDone {
		t.Errorf("a done job with forged records: %+v; want done", st)
	}
	if st := status(bad); st.State != worker.JobDeadLettered || st.DeadLetter != 2 {
		t.Errorf("a dead-lettered job with a purge record of its dead letter, which is still there: %+v; want dead-lettered", st)
	}
}
