package worker_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// NATS goes away and comes back while two workers run jobs: consumers are
// re-created, lost effects are published again, leases are kept or taken
// again, and every job ends up with its effect. Nothing is lost.
func TestNATSRestartLosesNothing(t *testing.T) {
	const n = 4
	e := newEnv(t, n, natstestListen()...)
	var runs runLog
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		time.Sleep(500 * time.Microsecond) // keep jobs in flight across the restart
		return j.Emit(ctx, j.Data)
	})
	for _, name := range []string{"a", "b"} {
		cfg := e.config(name, h)
		cfg.JetStream = e.srv.JetStream(t) // over TCP, reconnecting
		cfg.EffectTimeout = 2 * time.Second
		cfg.FetchWait = time.Second
		cfg.Observer = rec
		start(t, cfg)
	}
	enq := e.enqueue(t, 0, 2000)
	rec.waitFor(t, time.Minute, "jobs to flow", func() bool { return runs.n.Load() > 300 })
	e.srv.Restart(t)
	// A fresh connection: the test's own was in-process and did not survive.
	e.js = e.srv.JetStream(t)
	enq = append(enq, e.enqueue(t, 2000, 1000)...)

	want := map[[2]uint64]bool{}
	for _, q := range enq {
		want[[2]uint64{uint64(q.Partition), q.Seq}] = true
	}
	rec.waitFor(t, 2*time.Minute, "every job to run after the restart", func() bool {
		ran := distinct(runs.all())
		for k := range want {
			if ran[k] == 0 {
				return false
			}
		}
		return true
	})
	rec.waitFor(t, time.Minute, "every effect to be stored", func() bool {
		got, err := tryEffectKeys(e.js, e.prefix)
		return err == nil && len(got) >= len(want)
	})
	got := effectKeys(t, e.js, e.prefix)
	for k := range want {
		if !got[k] {
			t.Errorf("job %d of partition %d has no effect", k[1], k[0])
		}
	}
	t.Logf("%d jobs, %d runs, %d leases lost, %d acquisitions", len(want), len(runs.all()),
		rec.count(kind(worker.EventPartitionLost)), rec.count(kind(worker.EventPartitionAcquired)))
}

// effectKeys returns the (partition, job sequence) of every effect stored.
func effectKeys(t testing.TB, js jetstream.JetStream, prefix string) map[[2]uint64]bool {
	t.Helper()
	out, err := tryEffectKeys(js, prefix)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryEffectKeys is effectKeys for conditions that may run while the server
// is failing over.
func tryEffectKeys(js jetstream.JetStream, prefix string) (map[[2]uint64]bool, error) {
	msgs, err := tryReadStream(js, worker.EffectsStream(prefix))
	if err != nil {
		return nil, err
	}
	out := map[[2]uint64]bool{}
	for _, m := range msgs {
		if isBarrier(m) || markOf(m.Headers()).Abort {
			continue
		}
		s, err := leasehold.StampFromHeader(m.Headers())
		if err != nil {
			return nil, err
		}
		parts := strings.Split(s.Key, ".")
		seq, err := strconv.ParseUint(parts[len(parts)-2], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("effect key %q: %w", s.Key, err)
		}
		out[[2]uint64{uint64(s.Partition), seq}] = true
	}
	return out, nil
}

// abortingOn is a handler whose first attempt publishes two effects on
// subject and fails: the first effect leaves when the second is published,
// and the failed attempt then closes it with an abort marker. Later
// attempts emit one effect.
func abortingOn(subject string) worker.Handler {
	return worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if j.Attempt > 1 {
			return j.Emit(ctx, j.Data)
		}
		for _, d := range []string{"1", "2"} {
			if err := j.Publish(ctx, subject, []byte(d)); err != nil {
				return err
			}
		}
		return errors.New("this attempt fails after publishing")
	})
}

// waitSecondAttempt waits until the job at seq finishes its second
// attempt.
func waitSecondAttempt(t *testing.T, rec *recorder, seq uint64) {
	t.Helper()
	rec.waitFor(t, time.Minute, "the job's second attempt to finish", func() bool {
		return rec.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventJobFinished && ev.Seq == seq && ev.Attempt == 2
		}) > 0
	})
}

// An abort marker is published and waited for. When the server restarts
// after it received the marker and before it answered, the answer is
// lost: the wait must end with the connection, not at EffectTimeout, or
// the partition stands still for that long. Here the subject has a
// subscriber that never answers, so the answer is lost for sure, and
// EffectTimeout is longer than the test.
func TestAbortMarkerLostInARestartDoesNotHoldThePartition(t *testing.T) {
	e := newEnv(t, 1, natstestListen()...)
	hole := make(chan *nats.Msg, 16)
	nc := e.srv.Connect(t)
	if _, err := nc.ChanSubscribe("hole", hole); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := e.config("w", abortingOn("hole"))
	cfg.JetStream = e.srv.JetStream(t) // over TCP, reconnecting
	cfg.EffectTimeout = 10 * time.Minute
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	ctx := ctxFor(t, time.Minute)
	for abort := false; !abort; {
		select {
		case m := <-hole:
			abort = markOf(m.Header).Abort
		case <-ctx.Done():
			t.Fatal("no abort marker reached the subject")
		}
	}
	e.srv.Restart(t)
	waitSecondAttempt(t, rec, enq[0].Seq)
}

// In a cluster, an abort marker that reaches the stream's leader as it
// steps down is never answered, and the connection stays up. The marker
// is sent again rather than waited for until EffectTimeout, which would
// hold the partition that long. Here the subject's subscriber answers
// only the marker's second copy.
func TestAbortMarkerAnswerLostIsAskedForAgain(t *testing.T) {
	e := newEnv(t, 1)
	markers := make(chan string, 16)
	nc := e.srv.Connect(t)
	copies := 0
	if _, err := nc.Subscribe("lossy", func(m *nats.Msg) {
		if !markOf(m.Header).Abort {
			_ = m.Respond([]byte(`{"stream":"lossy","seq":1}`))
			return
		}
		markers <- m.Header.Get(jetstream.MsgIDHeader)
		if copies++; copies > 1 {
			_ = m.Respond([]byte(`{"stream":"lossy","seq":2}`))
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := e.config("w", abortingOn("lossy"))
	cfg.EffectTimeout = 10 * time.Minute
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	waitSecondAttempt(t, rec, enq[0].Seq)
	first, second := <-markers, <-markers
	if first == "" || first != second {
		t.Fatalf("the abort marker was sent again with Nats-Msg-Id %q, first %q: want the same", second, first)
	}
}

// The same for an effect: its acknowledgement lost on a connection that
// stays up is asked for again, under the same Nats-Msg-Id, rather than
// awaited until EffectTimeout, which would hold the partition's progress
// that long. Here the subject's subscriber answers only the effect's
// second copy.
func TestEffectAnswerLostIsAskedForAgain(t *testing.T) {
	e := newEnv(t, 1)
	copies := make(chan string, 16)
	nc := e.srv.Connect(t)
	n := 0
	if _, err := nc.Subscribe("lossy", func(m *nats.Msg) {
		copies <- m.Header.Get(jetstream.MsgIDHeader)
		if n++; n > 1 {
			_ = m.Respond([]byte(`{"stream":"lossy","seq":1}`))
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		return j.Publish(ctx, "lossy", j.Data)
	}))
	cfg.EffectTimeout = 10 * time.Minute
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	rec.waitFor(t, time.Minute, "the job's progress to be committed", func() bool {
		return rec.count(func(ev worker.Event) bool {
			return ev.Kind == worker.EventProgressCommitted && ev.Seq >= enq[0].Seq
		}) > 0
	})
	first, second := <-copies, <-copies
	if first == "" || first != second {
		t.Fatalf("the effect was sent again with Nats-Msg-Id %q, first %q: want the same", second, first)
	}
}
