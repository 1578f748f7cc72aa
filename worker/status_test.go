package worker_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A job's status goes through every state: scheduled (a delayed job before
// its time), pending (nobody holds its partition yet), running (by whom, at
// which epoch), done, and dead-lettered (with the reason); Wait waits for a
// set of jobs, a delayed one among them. A duplicate job ID is reported
// with the sequence of the job stored first.
func TestJobStatusThroughEveryState(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, time.Minute)
	p := e.statusProducer(t)
	status := func(ref worker.Enqueued) worker.JobStatus {
		t.Helper()
		st, err := p.Status(ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}

	slow, err := p.EnqueueTo(ctx, 0, []byte(`{"to":"slow"}`), worker.WithKind("email"), worker.JobID("slow-1"))
	if err != nil {
		t.Fatal(err)
	}
	dup, err := p.EnqueueTo(ctx, 0, []byte(`{"to":"other"}`), worker.WithKind("email"), worker.JobID("slow-1"))
	if err != nil || !dup.Duplicate || dup.Seq != slow.Seq || dup.Partition != slow.Partition {
		t.Fatalf("a second job with ID slow-1: %+v, %v; want a duplicate of sequence %d", dup, err, slow.Seq)
	}
	// The duplicate window spans partitions: a key of another partition
	// still finds the job stored first, where it is.
	other := []byte("k-0")
	for i := 1; leasehold.PartitionFor(other, e.n) == slow.Partition; i++ {
		other = []byte("k-" + strconv.Itoa(i))
	}
	if dup, err := p.Enqueue(ctx, other, []byte(`{}`), worker.JobID("slow-1")); err != nil || !dup.Duplicate || dup.Seq != slow.Seq || dup.Partition != slow.Partition {
		t.Fatalf("slow-1 again on another partition's key: %+v, %v; want a duplicate of %s", dup, err, slow.Ref())
	}
	dead, err := worker.Enqueue(ctx, p, "fax", email{To: "1985"}, worker.WithKey([]byte("k")))
	if err != nil {
		t.Fatal(err)
	}
	later, err := worker.Enqueue(ctx, p, "email", email{To: "later"}, worker.EnqueueIn(2*time.Second), worker.JobID("later-1"))
	if err != nil {
		t.Fatal(err)
	}
	ref, err := worker.ParseRef(later.Ref())
	if err != nil || ref.Partition != later.Partition || ref.Seq != later.Seq || ref.ID != later.ID || !ref.Due.Equal(later.Due) {
		t.Fatalf("ParseRef(%q) = %+v, %v; want %+v", later.Ref(), ref, err, later)
	}
	if st := status(later); st.State != worker.JobScheduled || !st.Due.Equal(later.Due) {
		t.Fatalf("a delayed job before its time: %+v", st)
	}
	if st := status(slow); st.State != worker.JobPending || st.Holder != "" {
		t.Fatalf("a job nobody holds the partition of: %+v", st)
	}

	started := make(chan *worker.Job, 1)
	release := make(chan struct{})
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(ctx context.Context, j *worker.Job, m email) error {
		if m.To == "slow" {
			started <- j
			<-release
		}
		return j.Emit(ctx, []byte(m.To))
	})
	start(t, e.config("w", mux))
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	var j *worker.Job
	select {
	case j = <-started:
	case <-ctx.Done():
		t.Fatal("the slow job never started")
	}
	if st := status(slow); st.State != worker.JobRunning || st.Holder != "w" || st.Epoch != j.Lease.Epoch {
		t.Fatalf("the running job: %+v; want running by w at epoch %d", st, j.Lease.Epoch)
	}

	// Wait returns once all are finished; the slow one finishes on release.
	waited := make(chan []worker.JobStatus, 1)
	go func() {
		sts, err := p.Wait(ctx, slow, dead, later)
		if err != nil {
			t.Error(err)
		}
		waited <- sts
	}()
	close(release)
	sts := <-waited
	if sts[0].State != worker.JobDone || sts[0].Progress < slow.Seq {
		t.Errorf("slow job after Wait: %+v", sts[0])
	}
	if sts[1].State != worker.JobDeadLettered || !strings.Contains(sts[1].Error, `kind "fax"`) || sts[1].DeadLetter == 0 {
		t.Errorf("unknown-kind job after Wait: %+v", sts[1])
	}
	if sts[2].State != worker.JobDone || sts[2].Seq <= later.Seq {
		t.Errorf("delayed job after Wait: %+v; want done as the job its schedule fired, after sequence %d", sts[2], later.Seq)
	}
	if st := status(later); st.State != worker.JobDone || st.Seq != sts[2].Seq {
		t.Errorf("delayed job's status: %+v", st)
	}
	if st := status(dead); st.State != worker.JobDeadLettered {
		t.Errorf("dead-lettered job's status: %+v", st)
	}

	// Wait is bounded by its context. The job's state is checked first,
	// under the test's own deadline: a short context is no time to check
	// it in, on a busy machine Wait's first look at the schedule can take
	// longer than that.
	never, err := p.EnqueueTo(ctx, 1, []byte(`{}`), worker.WithKind("email"), worker.EnqueueIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	for {
		st := status(never)
		if st.State == worker.JobScheduled {
			break
		}
		if st.State != worker.JobUnknown || st.Detail != "" {
			t.Fatalf("a job due in an hour: %+v, want scheduled", st)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("a job due in an hour was never reported scheduled: %+v", st)
		case <-time.After(20 * time.Millisecond):
		}
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	sts, err = p.Wait(short, never)
	// Wait must end with its context. Its report is what it learnt before
	// that: scheduled, or nothing yet (JobUnknown with no detail) when the
	// deadline cut its first look short; never a state that says the job
	// ran or is due.
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait for a job due in an hour: %v, %+v; want the context's deadline", err, sts)
	}
	if st := sts[0]; st.State != worker.JobScheduled && (st.State != worker.JobUnknown || st.Detail != "") {
		t.Fatalf("Wait for a job due in an hour ended with %+v; want it scheduled", st)
	}
}

// Wait follows many jobs at once, on every partition, and tells the
// dead-lettered ones apart.
func TestWaitForManyJobs(t *testing.T) {
	e := newEnv(t, 4)
	ctx := ctxFor(t, 2*time.Minute)
	p := e.statusProducer(t)
	b := p.Batch()
	for i := range 1000 {
		k := "email"
		if i%100 == 7 {
			k = "telex"
		}
		if err := b.Enqueue(ctx, []byte(strconv.Itoa(i)), []byte(`{"to":"x"}`), worker.WithKind(k)); err != nil {
			t.Fatal(err)
		}
	}
	jobs, err := b.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(ctx context.Context, j *worker.Job, m email) error { return j.Emit(ctx, []byte(m.To)) })
	for _, name := range []string{"a", "b"} {
		start(t, e.config(name, mux))
	}
	began := time.Now()
	sts, err := p.Wait(ctx, jobs...)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Wait for %d jobs returned %v after the workers started", len(jobs), time.Since(began).Round(time.Millisecond))
	counts := map[worker.JobState]int{}
	for i, st := range sts {
		counts[st.State]++
		if st.Seq != jobs[i].Seq || st.Partition != jobs[i].Partition {
			t.Fatalf("status %d is of %s, not %s", i, st.Ref, jobs[i].Ref())
		}
	}
	if counts[worker.JobDone] != 990 || counts[worker.JobDeadLettered] != 10 {
		t.Fatalf("states %v, want 990 done and 10 dead-lettered", counts)
	}
}

// The duplicate window is the stream's, and ProvisionJobs sets it on an
// existing stream when asked: after it, the same job ID is a new job.
func TestDuplicateWindowIsConfigurable(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, 30*time.Second)
	if err := worker.ProvisionJobs(ctx, e.js, worker.JobsConfig{Prefix: e.prefix, Partitions: e.n, Duplicates: time.Second, Schedules: true}); err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil || s.CachedInfo().Config.Duplicates != time.Second {
		t.Fatalf("duplicate window after ProvisionJobs: %v (%v)", s.CachedInfo().Config.Duplicates, err)
	}
	p := e.producer(t)
	first, err := p.Enqueue(ctx, nil, []byte("x"), worker.JobID("once"))
	if err != nil {
		t.Fatal(err)
	}
	if dup, err := p.Enqueue(ctx, nil, []byte("x"), worker.JobID("once")); err != nil || !dup.Duplicate || dup.Seq != first.Seq {
		t.Fatalf("within the window: %+v, %v", dup, err)
	}
	// Past the window (the server sweeps it at about its length), the ID
	// is free again: poll for it.
	for {
		again, err := p.Enqueue(ctx, nil, []byte("x"), worker.JobID("once"))
		if err != nil {
			t.Fatal(err)
		}
		if !again.Duplicate {
			if again.Seq <= first.Seq {
				t.Fatalf("a new job at sequence %d, not after %d", again.Seq, first.Seq)
			}
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the job ID stayed a duplicate long past a one-second window")
		case <-time.After(200 * time.Millisecond):
		}
	}
}
