package streamsink_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// A handler emits two effects and is still running: its first effect is
// in the log, its second held back. A forger copies the first effect's
// stamp and job headers into an abort marker. The handler then returns,
// its final is acknowledged and the worker commits the job: both effects
// are applied, once, and the forged abort is counted as suspicious. (A
// runner that let the abort close the attempt reported both effects
// aborted while the job was committed.)
func TestForgedAbortMidRun(t *testing.T) {
	t.Parallel()
	for _, topo := range []string{"single", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			h := newBlockingHandler(2)
			mw := newMarkerWorld(t, topo, "fabort", 3, nil, h.Handle)
			seq := mw.enqueue("job")
			if got := mw.awaitEmitted(h); got != seq {
				t.Fatalf("the handler ran job %d, want %d", got, seq)
			}
			first := mw.effectOf(seq, 0)
			mark, err := leasehold.JobMarkFromHeader(first.Header)
			if err != nil {
				t.Fatal(err)
			}
			forged := mw.forge(first, leasehold.JobMark{Job: mark.Job, Attempt: mark.Attempt, Abort: true}, nil)
			close(h.release)
			mw.awaitCommitted(seq)
			mw.awaitApplied(mw.wantKeys(seq, 2, "job"))
			mw.wantSuspect(forged, streamsink.SuspectAbortBeforeFinal)
		})
	}
}

// An abort marker with the largest attempt number, under the live holder's
// stamp, published for the next job before it runs, closes nothing: the
// job, of one effect or of two, is applied once it is committed. (A runner
// that took the abort as closing every attempt up to its number aborted
// the job's real attempt.)
func TestHugeAttemptAbortBeforeTheJob(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d-effects", n), func(t *testing.T) {
			mw := newMarkerWorld(t, "single", fmt.Sprintf("ahead%d", n), 3, nil, func(ctx context.Context, j *worker.Job) error {
				for i := range n {
					if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-%d", j.Data, i))); err != nil {
						return err
					}
				}
				return nil
			})
			l := mw.lease()
			ctx := ctxFor(t, 30*time.Second)
			s, err := mw.js.Stream(ctx, worker.JobsStream(mw.prefix))
			if err != nil {
				t.Fatal(err)
			}
			info, err := s.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			next := info.State.LastSeq + 1
			st := l.Stamp(worker.AbortKey(l.Scope, l.Partition, next, leasehold.MaxAttempt))
			h := nats.Header{}
			st.SetHeader(h)
			leasehold.JobMark{Job: next, Attempt: leasehold.MaxAttempt, Abort: true}.SetHeader(h)
			forged := mw.publish(worker.OutputSubject(mw.prefix, 0), h, nil)
			seq := mw.enqueue("job")
			if seq != next {
				t.Fatalf("the job was enqueued at %d, want %d", seq, next)
			}
			mw.awaitCommitted(seq)
			mw.awaitApplied(mw.wantKeys(seq, n, "job"))
			mw.wantSuspect(forged, streamsink.SuspectAbortUnknown)
		})
	}
}

// A forger copies the first effect of a running attempt into a final of
// the next attempt number, with data of its own, claiming one effect. The
// job's real attempt completes and is applied, once, with its own data;
// the forged final is not. (A runner that let a higher attempt supersede
// an open one applied the forged data under the first key and took the
// real final for a duplicate.)
func TestForgedFinalOfAHigherAttempt(t *testing.T) {
	t.Parallel()
	h := newBlockingHandler(2)
	mw := newMarkerWorld(t, "single", "ffinal", 3, nil, h.Handle)
	seq := mw.enqueue("job")
	mw.awaitEmitted(h)
	first := mw.effectOf(seq, 0)
	mark, err := leasehold.JobMarkFromHeader(first.Header)
	if err != nil {
		t.Fatal(err)
	}
	forged := mw.forge(first, leasehold.JobMark{Job: mark.Job, Attempt: mark.Attempt + 1, Effects: 1}, []byte("forged"))
	close(h.release)
	mw.awaitCommitted(seq)
	mw.awaitApplied(mw.wantKeys(seq, 2, "job"))
	if d, ok := mw.decisionAt(forged); !ok || d.Outcome != sink.Aborted {
		t.Errorf("the forged final at %d was decided %v (reported %v), want aborted", forged, d.Outcome, ok)
	}
}

// Markers no worker writes are set aside, each with its reason, and change
// nothing the worker's own messages decide: an effect whose key names
// another job, a final that repeats a key its attempt holds, an attempt
// holding more effects than its final counts (applied whole), an attempt
// that first appears after a higher one of its job, and an abort of an
// attempt above every one of its lease.
func TestSuspiciousMarkersSetAside(t *testing.T) {
	t.Parallel()
	wl := newWireLog(t, "sus")
	r := start(t, wl.js, wl.cfg)
	wantSuspect := func(pos uint64, outcome sink.Outcome, reason string) {
		t.Helper()
		if d, ok := wl.rec.at(pos); !ok || d.Outcome != outcome || d.Suspect != reason {
			t.Errorf("log position %d: %v suspect %q (reported %v), want %v suspect %q", pos, d.Outcome, d.Suspect, ok, outcome, reason)
		}
	}

	otherKey := wl.pub(1, wl.key(71, 0), leasehold.JobMark{Job: 70, Attempt: 1, Effects: 1}, false)

	wl.effect(72, 2, 0)
	reused := wl.pub(1, wl.key(72, 0), leasehold.JobMark{Job: 72, Attempt: 2, Effects: 1, After: 0}, false)
	f72 := wl.final(72, 2, 1, 0)

	wl.effect(73, 3, 0)
	wl.effect(73, 3, 1)
	wl.effect(73, 3, 2)
	over := wl.pub(1, wl.key(73, 3), leasehold.JobMark{Job: 73, Attempt: 3, Effects: 2, After: 72}, false)

	wl.effect(74, 5, 0)
	late := wl.effect(74, 4, 0)
	f74 := wl.final(74, 5, 1, 73)

	unknown := wl.pub(1, "sus.0.75.abort.99", leasehold.JobMark{Job: 75, Attempt: 99, Abort: true}, false)
	s := wl.pub(1, "s", leasehold.JobMark{}, false)
	wl.wait(r, s)

	wl.want(map[string]int{"s": 1, wl.key(72, 0): 1, wl.key(72, 1): 1,
		wl.key(73, 0): 1, wl.key(73, 1): 1, wl.key(73, 2): 1, wl.key(73, 3): 1,
		wl.key(74, 0): 1, wl.key(74, 1): 1})
	wantSuspect(otherKey, sink.Aborted, streamsink.SuspectJobKey)
	wantSuspect(reused, sink.Aborted, streamsink.SuspectFinalKey)
	wantSuspect(f72, sink.Accepted, "")
	wantSuspect(over, sink.Accepted, streamsink.SuspectOverCount)
	wantSuspect(late, sink.Aborted, streamsink.SuspectAttemptOrder)
	wantSuspect(f74, sink.Accepted, "")
	wantSuspect(unknown, sink.Aborted, streamsink.SuspectAbortUnknown)
}
