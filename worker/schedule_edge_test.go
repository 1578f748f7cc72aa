package worker_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/worker"
)

// EnqueueAt takes any time.Time. A time in the past runs at once (as the
// documentation says); one the server cannot write as RFC 3339 (past year
// 9999, before year 0) is refused at the producer, not stored as a
// schedule that never fires.
func TestEnqueueAtExtremes(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	p := e.producer(t)
	for _, at := range []time.Time{time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(-1, 1, 1, 0, 0, 0, 0, time.UTC)} {
		if got, err := p.EnqueueTo(ctx, 0, []byte(`{}`), worker.WithKind("email"), worker.EnqueueAt(at)); err == nil {
			t.Errorf("EnqueueAt(%v): stored %+v; want an error", at, got)
		}
	}
	past, err := p.EnqueueTo(ctx, 0, []byte(`{}`), worker.WithKind("email"), worker.EnqueueAt(time.Now().Add(-time.Hour)))
	if err != nil {
		t.Fatalf("EnqueueAt an hour ago: %v", err)
	}
	ran := make(chan *worker.Job, 10)
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(_ context.Context, j *worker.Job, _ email) error { ran <- j; return nil })
	start(t, e.config("w", mux))
	select {
	case j := <-ran:
		if j.Seq <= past.Seq {
			t.Errorf("the job ran at sequence %d, not after its schedule's %d", j.Seq, past.Seq)
		}
	case <-ctx.Done():
		t.Fatal("a job due an hour ago never ran")
	}
}

// Re-registering a periodic job with a changed interval, as a rolling
// deploy does, leaves one schedule, the new one; registering it again
// unchanged, as every restart does, stores nothing.
func TestPeriodicRedeclared(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, time.Minute)
	p := e.producer(t)
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	subject := worker.PeriodicSubject(e.prefix, "report")
	stored := func() (uint64, string) {
		t.Helper()
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
		if err != nil {
			t.Fatal(err)
		}
		m, err := s.GetLastMsgForSubject(ctx, subject)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Subjects[subject], m.Header.Get("Nats-Schedule") + " seq " + strconv.FormatUint(m.Sequence, 10)
	}
	for _, every := range []time.Duration{time.Hour, time.Hour, 2 * time.Hour, 2 * time.Hour} {
		if err := p.Schedule(ctx, worker.Periodic{Name: "report", Kind: "report", Every: every}); err != nil {
			t.Fatal(err)
		}
	}
	n, what := stored()
	if n != 1 || !strings.HasPrefix(what, "@every 2h0m0s seq 2") {
		t.Errorf("after registering 1h twice and 2h twice: %d schedules, the last %q; want one, @every 2h0m0s at sequence 2", n, what)
	}
}
