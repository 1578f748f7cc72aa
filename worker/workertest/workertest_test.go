package workertest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/workertest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

type order struct {
	ID    string `json:"id"`
	Total int    `json:"total"`
}

// ship emits the order on the partition's output and an audit line on a
// subject of its own.
func ship(ctx context.Context, job *worker.Job, o order) error {
	if err := job.Emit(ctx, []byte("shipped "+o.ID)); err != nil {
		return err
	}
	if err := job.Publish(ctx, "audit."+o.ID, []byte(strconv.Itoa(o.Total))); err != nil {
		return err
	}
	return job.Emit(ctx, []byte("billed "+o.ID))
}

func TestEffectsStampedAsAWorkerStampsThem(t *testing.T) {
	mux := worker.NewMux()
	worker.Handle(mux, "ship", ship)
	h := workertest.New(t, workertest.Config{
		Handler: mux,
		Worker:  worker.Config{Prefix: "shop", Partitions: 4},
		Lease:   leasehold.Lease{Epoch: 42, Acquisition: "acq7", Holder: "w1"},
	})
	res := workertest.Work(t.Context(), h, "ship", order{ID: "o1", Total: 30}, worker.WithKey([]byte("customer-9")))
	res.RequireDone()
	part := leasehold.PartitionFor([]byte("customer-9"), 4)
	out := worker.OutputSubject("shop", part)
	effects := res.RequireEffects(
		// The last effect on each subject is held until the handler
		// returns, then leaves as the subject's final, in the order the
		// subjects were first used.
		workertest.Want{Subject: out, Data: []byte("shipped o1")},
		workertest.Want{Subject: out, Data: []byte("billed o1")},
		workertest.Want{Subject: "audit.o1", Data: []byte("30")},
	)
	for i, index := range []int{0, 2, 1} {
		e := effects[i]
		want := leasehold.Stamp{Scope: "shop", Partition: part, Epoch: 42, Acquisition: "acq7", Key: leasehold.EffectKey("shop", part, res.Seq, index), Worker: "w1"}
		if e.Stamp != want {
			t.Errorf("effect %d stamped %+v, want %+v", i, e.Stamp, want)
		}
		if e.Stamp.Key != res.Key(index) {
			t.Errorf("effect %d key %q, Result.Key says %q", i, e.Stamp.Key, res.Key(index))
		}
	}
	// The first effect on the output is not its final; the second and the
	// audit line are, each counting the attempt's effects on its subject.
	if effects[0].Mark.Final() || effects[1].Mark.Effects != 2 || effects[2].Mark.Effects != 1 {
		t.Errorf("finals: %+v %+v %+v", effects[0].Mark, effects[1].Mark, effects[2].Mark)
	}
}

func TestCheckRefusesWhatAWorkerWouldNotSend(t *testing.T) {
	h := workertest.New(t, workertest.Config{Handler: worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		if err := job.Emit(ctx, []byte("a")); err != nil {
			return err
		}
		return job.Emit(ctx, []byte("b"))
	})})
	res := h.Run(t.Context(), []byte("k"), []byte("job"))
	res.RequireDone()
	job := res.Attempts[0].Job
	good := res.Effects()
	if err := workertest.Check(job, good); err != nil {
		t.Fatalf("the worker's own effects: %v", err)
	}
	for name, tamper := range map[string]func([]workertest.Effect){
		"epoch":     func(es []workertest.Effect) { es[0].Stamp.Epoch++ },
		"key order": func(es []workertest.Effect) { es[0].Stamp.Key, es[1].Stamp.Key = es[1].Stamp.Key, es[0].Stamp.Key },
		"final":     func(es []workertest.Effect) { es[0].Mark.Effects = 1 },
		"msg id":    func(es []workertest.Effect) { es[1].MessageID = es[1].Stamp.Key },
		"job":       func(es []workertest.Effect) { es[1].Mark.Job++ },
	} {
		es := append([]workertest.Effect(nil), good...)
		tamper(es)
		if err := workertest.Check(job, es); err == nil {
			t.Errorf("%s tampered with: Check found nothing wrong", name)
		}
	}
}

func TestRetriesKeepTheKeys(t *testing.T) {
	runs := 0
	h := workertest.New(t, workertest.Config{
		Handler: worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
			runs++
			if err := job.Emit(ctx, []byte("try "+strconv.Itoa(runs))); err != nil {
				return err
			}
			if runs < 3 {
				return fmt.Errorf("flaky %d", runs)
			}
			return nil
		}),
		Worker: worker.Config{MaxAttempts: 5, Backoff: func(n int) time.Duration { return time.Duration(n) * time.Second }},
	})
	res := h.Run(t.Context(), []byte("k"), []byte("job"))
	res.RequireDone()
	if len(res.Attempts) != 3 || res.Retries() != 2 {
		t.Fatalf("want 3 attempts: %s", res)
	}
	for i, a := range res.Attempts[:2] {
		if !a.Counted || a.Wait != time.Duration(i+1)*time.Second {
			t.Errorf("attempt %d: counted %v, wait %v; want counted and the Backoff's %v", i+1, a.Counted, a.Wait, time.Duration(i+1)*time.Second)
		}
		// A failed attempt's held effect never leaves: it published nothing.
		if len(a.Published) != 0 {
			t.Errorf("failed attempt %d published %d messages", i+1, len(a.Published))
		}
	}
	e := res.RequireEffects(workertest.Want{Subject: worker.OutputSubject("test", 0), Data: []byte("try 3")})
	if e[0].Stamp.Key != res.Key(0) {
		t.Errorf("the third attempt's key %q, the job's first %q", e[0].Stamp.Key, res.Key(0))
	}
	if n := len(h.Effects()); n != 1 {
		t.Errorf("%d effects in all, want 1", n)
	}
	var failed, finished int
	for _, ev := range h.Events() {
		switch ev.Kind {
		case worker.EventJobFailed:
			failed++
		case worker.EventJobFinished:
			finished++
		}
	}
	if failed != 2 || finished != 1 {
		t.Errorf("events: %d failed, %d finished; want 2 and 1", failed, finished)
	}
}

func TestAbortMarkerClosesAFailedAttempt(t *testing.T) {
	runs := 0
	h := workertest.New(t, workertest.Config{Handler: worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
		runs++
		for i := range 2 {
			if err := job.Emit(ctx, []byte{byte('a' + i)}); err != nil {
				return err
			}
		}
		if runs == 1 {
			return errors.New("after the first effect left")
		}
		return nil
	})})
	res := h.Run(t.Context(), []byte("k"), []byte("job"))
	res.RequireDone()
	first := res.Attempts[0].Published
	if len(first) != 2 {
		t.Fatalf("the failed attempt published %d messages, want its first effect and an abort marker", len(first))
	}
	mark, err := leasehold.JobMarkFromHeader(first[1].Header)
	if err != nil || !mark.Abort {
		t.Fatalf("second message of the failed attempt: %+v %v, want an abort marker", mark, err)
	}
	res.RequireEffects(workertest.Want{Subject: worker.OutputSubject("test", 0), Data: []byte("a")}, workertest.Want{Subject: worker.OutputSubject("test", 0), Data: []byte("b")})
}

func TestDeadLetters(t *testing.T) {
	mux := worker.NewMux()
	worker.Handle(mux, "bad", func(ctx context.Context, job *worker.Job, v order) error {
		return worker.Permanent(errors.New("no such customer"))
	})
	worker.Handle(mux, "flaky", func(ctx context.Context, job *worker.Job, v order) error {
		return errors.New("down")
	})
	worker.Handle(mux, "panics", func(ctx context.Context, job *worker.Job, v order) error {
		panic("boom")
	})
	worker.Handle(mux, "slow", func(ctx context.Context, job *worker.Job, v order) error {
		<-ctx.Done()
		return ctx.Err()
	})
	h := workertest.New(t, workertest.Config{Handler: mux, Worker: worker.Config{MaxAttempts: 3, HandleTimeout: 50 * time.Millisecond}})
	ctx := t.Context()

	dl := workertest.Work(ctx, h, "bad", order{ID: "o1"}).RequireDeadLettered()
	if dl.Attempts != 1 || dl.Msg.Header.Get(worker.HeaderKind) != "bad" || dl.Msg.Header.Get(worker.HeaderAttempts) != "1" {
		t.Errorf("permanent: %d attempts, headers %v", dl.Attempts, dl.Msg.Header)
	}
	st, err := leasehold.StampFromHeader(dl.Msg.Header)
	if err != nil || st.Key != worker.DeadLetterKey("test", 0, 1) || st.Epoch != 1 {
		t.Errorf("dead letter stamp %+v %v", st, err)
	}

	res := workertest.Work(ctx, h, "flaky", order{ID: "o2"})
	if dl := res.RequireDeadLettered(); dl.Attempts != 3 || dl.Error != "down" {
		t.Errorf("flaky: %s", res)
	}

	res = workertest.Work(ctx, h, "panics", order{ID: "o3"})
	res.RequireDeadLettered()
	var pe *worker.PanicError
	if !errors.As(res.Err(), &pe) || pe.Value != "boom" {
		t.Errorf("panic: %s", res)
	}

	res = workertest.Work(ctx, h, "slow", order{ID: "o4"})
	res.RequireDeadLettered()
	if !errors.Is(res.Err(), worker.ErrHandleTimeout) {
		t.Errorf("timeout: %s", res)
	}

	res = workertest.Work(ctx, h, "unknown", order{ID: "o5"})
	res.RequireDeadLettered()
	if !errors.Is(res.Err(), worker.ErrUnknownKind) || !worker.IsPermanent(res.Err()) {
		t.Errorf("unknown kind: %s", res)
	}

	res = h.Run(ctx, []byte("k"), []byte("{not json"), worker.WithKind("bad"))
	if dl := res.RequireDeadLettered(); dl.Attempts != 1 {
		t.Errorf("undecodable: %s", res)
	}
}

func TestStaleEpochAndLostLeaseStopThePartition(t *testing.T) {
	fences := sink.NewMemory(sink.MemoryConfig{KeepLog: true, Logger: slog.New(slog.DiscardHandler)})
	var h *workertest.Harness
	mux := worker.NewMux()
	worker.Handle(mux, "apply", func(ctx context.Context, job *worker.Job, v order) error {
		return job.Apply(ctx, fences, "orders."+v.ID, []byte("x"))
	})
	worker.Handle(mux, "lose", func(ctx context.Context, job *worker.Job, v order) error {
		h.Lose(job.Partition, errors.New("taken over"))
		<-ctx.Done()
		return job.Emit(ctx, []byte("late"))
	})
	h = workertest.New(t, workertest.Config{Handler: mux, Lease: leasehold.Lease{Epoch: 5}})
	ctx := t.Context()

	workertest.Work(ctx, h, "apply", order{ID: "o1"}).RequireDone()
	if got := fences.Applied(); len(got) != 1 || got[0].Stamp.Epoch != 5 {
		t.Fatalf("sink holds %+v", got)
	}
	// A successor fences the sink at a higher epoch: this one's next write
	// is refused, and the partition stops.
	next := h.Lease(0)
	next.Epoch, next.Acquisition = 6, "successor"
	if err := fences.Advance(ctx, next); err != nil {
		t.Fatal(err)
	}
	res := workertest.Work(ctx, h, "apply", order{ID: "o2"})
	res.RequireStopped(leasehold.ErrStaleEpoch)
	if len(res.Attempts) != 1 {
		t.Errorf("a stale refusal is not retried: %s", res)
	}

	res = workertest.Work(ctx, h, "lose", order{ID: "o3"})
	res.RequireStopped(leasehold.ErrLeaseLost)
	if len(h.Effects()) != 0 {
		t.Errorf("published after the lease was lost: %+v", h.Effects())
	}
	// The partition's later jobs stop at once: the lease is gone.
	workertest.Work(ctx, h, "apply", order{ID: "o4"}).RequireStopped(leasehold.ErrLeaseLost)
	if got := fences.Applied(); len(got) != 1 {
		t.Errorf("the sink holds %d effects, want the first job's alone", len(got))
	}
}

func TestKindOptionsApply(t *testing.T) {
	mux := worker.NewMux()
	worker.Handle(mux, "charge", func(ctx context.Context, job *worker.Job, o order) error {
		return errors.New("card declined")
	}, worker.MaxAttempts(2), worker.Backoff(func(n int) time.Duration { return time.Hour }))
	worker.Handle(mux, "quick", func(ctx context.Context, job *worker.Job, o order) error {
		<-ctx.Done()
		return ctx.Err()
	}, worker.Timeout(time.Millisecond), worker.MaxAttempts(1))
	h := workertest.New(t, workertest.Config{Handler: mux, Worker: worker.Config{MaxAttempts: 9, HandleTimeout: time.Hour}})
	res := workertest.Work(t.Context(), h, "charge", order{ID: "o1"})
	if dl := res.RequireDeadLettered(); dl.Attempts != 2 || res.Attempts[0].Wait != time.Hour {
		t.Errorf("charge: %s", res)
	}
	res = workertest.Work(t.Context(), h, "quick", order{ID: "o2"})
	if res.RequireDeadLettered(); !errors.Is(res.Err(), worker.ErrHandleTimeout) {
		t.Errorf("quick: %s", res)
	}
}

func TestSnoozesAreNotAttempts(t *testing.T) {
	runs := 0
	h := workertest.New(t, workertest.Config{
		Handler: worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error {
			if runs++; runs <= 2 {
				return worker.Snooze(time.Minute)
			}
			return job.Emit(ctx, []byte("ready"))
		}),
		Worker: worker.Config{MaxAttempts: 1, MaxSnoozes: 2},
	})
	res := h.Run(t.Context(), []byte("k"), []byte("job"))
	res.RequireDone()
	if len(res.Attempts) != 3 || !res.Attempts[0].Snoozed || res.Attempts[0].Counted || res.Attempts[1].Wait != time.Minute {
		t.Fatalf("want two snoozes of a minute, then success: %s", res)
	}
	runs = 0
	h2 := workertest.New(t, workertest.Config{
		Handler: worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error { return worker.Snooze(time.Second) }),
		Worker:  worker.Config{MaxAttempts: 1, MaxSnoozes: 2},
	})
	res = h2.Run(t.Context(), []byte("k"), []byte("job"))
	if res.RequireDeadLettered(); !errors.Is(res.Err(), worker.ErrSnoozeLimit) || len(res.Attempts) != 3 {
		t.Errorf("past the snooze limit: %s", res)
	}
	var snoozed int
	for _, ev := range h2.Events() {
		if ev.Kind == worker.EventJobSnoozed {
			snoozed++
		}
	}
	if snoozed != 2 {
		t.Errorf("%d snoozed events, want 2", snoozed)
	}
}

func TestDelayedJobsNeedAServer(t *testing.T) {
	h := workertest.New(t, workertest.Config{Handler: worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil })})
	if _, err := h.Producer().Enqueue(t.Context(), []byte("k"), []byte("later"), worker.EnqueueIn(time.Minute)); !errors.Is(err, worker.ErrNoSchedules) {
		t.Fatalf("a delayed job in memory: %v, want ErrNoSchedules", err)
	}
	if h.Pending() != 0 {
		t.Fatalf("%d jobs pending", h.Pending())
	}
}

// A Mux wrapped by hand is not in the worker's view: its kinds' options
// are not applied, and the worker says so.
func TestWrappedMuxSaysItsOptionsAreNotApplied(t *testing.T) {
	var logs bytes.Buffer
	mux := worker.NewMux()
	worker.Handle(mux, "charge", func(ctx context.Context, job *worker.Job, o order) error {
		return errors.New("declined")
	}, worker.MaxAttempts(1))
	wrapped := worker.HandlerFunc(func(ctx context.Context, job *worker.Job) error { return mux.Handle(ctx, job) })
	h := workertest.New(t, workertest.Config{Handler: wrapped, Worker: worker.Config{MaxAttempts: 3, Logger: slog.New(slog.NewTextHandler(&logs, nil))}})
	res := workertest.Work(t.Context(), h, "charge", order{ID: "o1"})
	if dl := res.RequireDeadLettered(); dl.Attempts != 3 {
		t.Errorf("%d attempts, want the worker's 3", dl.Attempts)
	}
	if n := strings.Count(logs.String(), "is not the worker's Config.Handler"); n != 1 {
		t.Errorf("the warning was logged %d times, want once:\n%s", n, logs.String())
	}
}
