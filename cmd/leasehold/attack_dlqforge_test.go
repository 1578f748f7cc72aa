package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A dead letter forged in the job dead-letter stream (by any credential
// that may publish there: every worker's) with a Leasehold-Origin naming
// a place in the job stream that no job holds yet, laundered onto the job
// stream by the operator's `leasehold dlq replay --all` (which checks
// that the origin parses, not that it precedes the dead letter's job).
// The worker runs the replay under the keys of that place and commits it;
// the stream sink sets its effect aside as suspicious (its key names
// another job). The job a producer stores at that place next runs after
// it, names it in Leasehold-After, succeeds and is committed. Its effect
// must be applied: the runner must not wait for ever on the job it set
// aside. (Before the runner settled such a job from the fence records'
// committed progress, it held the victim's effect with Ready nil.)
func TestAttackForgedDeadLetterDoesNotHoldAFutureJob(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rw := newReplayWorld(t, ctx, "fdl")
	p, err := worker.NewProducer(rw.js, worker.ProducerConfig{Prefix: rw.prefix, Partitions: 1, Bucket: rw.bucket})
	if err != nil {
		t.Fatal(err)
	}
	first, err := p.Enqueue(ctx, []byte("a"), []byte("first"))
	if err != nil {
		t.Fatal(err)
	}
	// The replay will be stored at first.Seq+1, the next job at +2.
	victimSeq := first.Seq + 2
	forged := &nats.Msg{Subject: worker.DLQSubject(rw.prefix, 0), Data: []byte("forged"), Header: nats.Header{}}
	forged.Header.Set(worker.HeaderSubject, worker.JobSubject(rw.prefix, 0))
	forged.Header.Set(worker.HeaderSeq, "1")
	forged.Header.Set(worker.HeaderError, "the ledger is closed for the night")
	forged.Header.Set(worker.HeaderAttempts, "3")
	forged.Header.Set(leasehold.HeaderOrigin, leasehold.OriginOf(rw.prefix, 0, victimSeq).String())
	if _, err := rw.js.PublishMsg(ctx, forged); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, ctx, "dlq", "replay", "--all", "--nats", rw.url, "--prefix", rw.prefix)
	t.Logf("dlq replay --all: %v\n%s", err, out)
	if err != nil {
		// The replay refuses an origin past its dead letter's job: store
		// what it would have stored, as a raw publisher on the job
		// subject can, and the worker must refuse it too.
		if !strings.Contains(err.Error(), "forged") {
			t.Fatal(err)
		}
		m := &nats.Msg{Subject: worker.JobSubject(rw.prefix, 0), Data: []byte("forged"), Header: nats.Header{}}
		m.Header.Set(leasehold.HeaderOrigin, leasehold.OriginOf(rw.prefix, 0, victimSeq).String())
		if _, err := rw.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	victim, err := p.Enqueue(ctx, []byte("v"), []byte("victim"))
	if err != nil {
		t.Fatal(err)
	}
	if victim.Seq != victimSeq {
		t.Fatalf("the victim was stored at %d, not %d", victim.Seq, victimSeq)
	}
	prog, _ := rw.startWorker(t, "w", 3, func(ctx context.Context, j *worker.Job) error {
		return j.Emit(ctx, []byte(fmt.Sprintf("credit of %s", j.Data)))
	})
	prog.wait(t, ctx, 0, victim.Seq)
	rw.settle(t, ctx)
	key := leasehold.EffectKey(rw.prefix, 0, victim.Seq, 0)
	// The runner has read the whole log: give it ten seconds more to
	// apply what it holds.
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for applied := false; !applied; {
		rw.mu.Lock()
		for _, v := range rw.applied[key] {
			applied = applied || v == "credit of victim"
		}
		rw.mu.Unlock()
		if applied {
			break
		}
		select {
		case <-rw.notify:
		case <-wctx.Done():
			applied = true
		}
	}
	rw.mu.Lock()
	got := rw.applied[key]
	all := fmt.Sprint(rw.applied)
	rw.mu.Unlock()
	st, err := p.Status(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	if st.State != worker.JobDone {
		t.Logf("the victim is %s (%s)", st.State, st.Detail)
	}
	if st.State == worker.JobDone && (len(got) == 0 || got[0] != "credit of victim") {
		t.Fatalf("LOST: job %s is done and emitted %q under key %s; the destination holds %q there (the runner's decisions on the key: %v; everything applied: %s; runner ready: %v)",
			victim.Ref(), "credit of victim", key, got, rw.decisionsOf(key), all, rw.runner.Ready(ctx))
	}
}
