package worker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// "Nats-Rollup: all" on one job subject purges every subject of the job
// stream: the other partitions' pending jobs and every schedule. Only the
// partition it lands on sees it, so its dead letter is the one place that
// can say how much went: it must not say one partition's jobs went when
// all did.
func TestRollupAllPurgesEveryPartition(t *testing.T) {
	e := newEnv(t, 2)
	p := e.producer(t)
	ctx := ctxFor(t, time.Minute)
	for _, part := range []int{0, 1} {
		if _, err := p.EnqueueTo(ctx, leasehold.Partition(part), []byte(`{}`), worker.WithKind("email")); err != nil {
			t.Fatal(err)
		}
	}
	forged := &nats.Msg{Subject: worker.JobSubject(e.prefix, 1), Data: []byte(`{}`), Header: nats.Header{"Nats-Rollup": []string{"all"}, worker.HeaderKind: []string{"email"}}}
	if _, err := e.js.PublishMsg(ctx, forged); err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("the job stream holds %d messages after a roll-up of all; the server kept more than the roll-up", info.State.Msgs)
	}
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(context.Context, *worker.Job, email) error { return nil })
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the roll-up to be dead-lettered", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) == 1 })
	dlq := deadLetters(t, e)
	if len(dlq) != 1 {
		t.Fatalf("%d dead letters; want the roll-up's", len(dlq))
	}
	if why := dlq[0].Headers().Get(worker.HeaderError); !strings.Contains(why, "every partition") {
		t.Errorf("the roll-up's dead letter says %q; it purged every partition's jobs and every schedule, and should say so", why)
	}
}

// The roll-up check sat in Mux alone: a worker with a plain handler ran a
// forged roll-up as one more job, and the jobs it purged went unseen.
func TestRollupReachesAPlainHandler(t *testing.T) {
	e := newEnv(t, 1)
	p := e.producer(t)
	ctx := ctxFor(t, time.Minute)
	if _, err := p.EnqueueTo(ctx, 0, []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	forged := &nats.Msg{Subject: worker.JobSubject(e.prefix, 0), Data: []byte(`{}`), Header: nats.Header{"Nats-Rollup": []string{"sub"}}}
	if _, err := e.js.PublishMsg(ctx, forged); err != nil {
		t.Fatal(err)
	}
	ran := make(chan uint64, 10)
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error { ran <- j.Seq; return nil }))
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the roll-up to be dead-lettered", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) == 1 })
	select {
	case seq := <-ran:
		t.Errorf("the handler ran the roll-up (sequence %d)", seq)
	default:
	}
	dlq := deadLetters(t, e)
	if len(dlq) != 1 || !strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "carries a Nats-Rollup header") {
		t.Fatalf("%d dead letters; want the roll-up's, saying what it did", len(dlq))
	}
}
