package worker_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/worker"
)

type email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
}

type invoice struct {
	Number int   `json:"number"`
	Cents  int64 `json:"cents"`
}

// upperCodec is a codec other than JSON: "to|subject".
type upperCodec struct{}

func (upperCodec) Marshal(v any) ([]byte, error) {
	e := v.(email)
	return []byte(e.To + "|" + e.Subject), nil
}

func (upperCodec) Unmarshal(data []byte, v any) error {
	to, subj, _ := strings.Cut(string(data), "|")
	*v.(*email) = email{To: to, Subject: subj}
	return nil
}

// Each kind runs its own typed handler, whatever partition its job is on;
// a partition's jobs of several kinds still run in their order, and the
// kind does not change the lease or the effect keys.
func TestMuxRoutesByKind(t *testing.T) {
	e := newEnv(t, 2)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)

	var mu sync.Mutex
	var got []string
	var seqs []uint64
	mux := worker.NewMux()
	worker.Handle(mux, "email", func(ctx context.Context, j *worker.Job, m email) error {
		mu.Lock()
		got = append(got, "email:"+m.To+":"+m.Subject)
		seqs = append(seqs, j.Seq)
		mu.Unlock()
		return j.Emit(ctx, []byte(m.To))
	})
	worker.Handle(mux, "invoice", func(ctx context.Context, j *worker.Job, v invoice) error {
		mu.Lock()
		got = append(got, "invoice:"+strconv.Itoa(v.Number)+":"+strconv.FormatInt(v.Cents, 10))
		seqs = append(seqs, j.Seq)
		mu.Unlock()
		return j.Emit(ctx, []byte(strconv.Itoa(v.Number)))
	})
	worker.HandleWith(mux, "email.plain", upperCodec{}, func(ctx context.Context, j *worker.Job, m email) error {
		mu.Lock()
		got = append(got, "plain:"+m.To+":"+m.Subject)
		seqs = append(seqs, j.Seq)
		mu.Unlock()
		return nil
	})
	if k := mux.Kinds(); strings.Join(k, ",") != "email,email.plain,invoice" {
		t.Fatalf("Kinds() = %v", k)
	}

	key := worker.WithKey([]byte("customer-1"))
	var enq []worker.Enqueued
	for _, f := range []func() (worker.Enqueued, error){
		func() (worker.Enqueued, error) {
			return worker.Enqueue(ctx, p, "email", email{To: "ann", Subject: "hi"}, key)
		},
		func() (worker.Enqueued, error) {
			return worker.Enqueue(ctx, p, "invoice", invoice{Number: 7, Cents: 1250}, key)
		},
		func() (worker.Enqueued, error) {
			return worker.Enqueue(ctx, p, "email.plain", email{To: "bob", Subject: "yo"}, key, worker.WithCodec(upperCodec{}))
		},
		func() (worker.Enqueued, error) {
			return worker.Enqueue(ctx, p, "email", email{To: "cid", Subject: "bye"}, key)
		},
	} {
		q, err := f()
		if err != nil {
			t.Fatal(err)
		}
		enq = append(enq, q)
	}
	for _, q := range enq[1:] {
		if q.Partition != enq[0].Partition {
			t.Fatalf("jobs of one key went to partitions %d and %d", enq[0].Partition, q.Partition)
		}
	}

	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "every job", func() bool { return rec.count(kind(worker.EventJobFinished)) == len(enq) })
	mu.Lock()
	defer mu.Unlock()
	want := []string{"email:ann:hi", "invoice:7:1250", "plain:bob:yo", "email:cid:bye"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("handled %v, want %v", got, want)
	}
	for i, q := range enq {
		if seqs[i] != q.Seq {
			t.Fatalf("job %d ran as sequence %d, enqueued as %d", i, seqs[i], q.Seq)
		}
	}
	if n := rec.count(kind(worker.EventJobDeadLettered)); n != 0 {
		t.Fatalf("%d jobs dead-lettered", n)
	}
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobStarted && ev.Job.Lease.Scope != e.prefix {
			t.Fatalf("job of kind %s ran under scope %q", ev.Job.Kind(), ev.Job.Lease.Scope)
		}
	}
}

// A job of a kind no handler serves, one without a kind, one with a kind
// header that is not a kind, and one whose payload does not decode are
// each dead-lettered at once with the reason; the jobs around them run.
func TestMuxDeadLettersUnknownKinds(t *testing.T) {
	e := newEnv(t, 1)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	mux := worker.NewMux()
	var ran sync.Map
	worker.Handle(mux, "email", func(ctx context.Context, j *worker.Job, m email) error {
		ran.Store(m.To, true)
		return nil
	})

	mustEnq := func(q worker.Enqueued, err error) worker.Enqueued {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return q
	}
	mustEnq(worker.Enqueue(ctx, p, "email", email{To: "first"}))
	unknown := mustEnq(worker.Enqueue(ctx, p, "sms", map[string]string{"to": "+4412345"}))
	unkinded := mustEnq(p.EnqueueTo(ctx, 0, []byte(`{"to":"nobody"}`)))
	forged := mustEnq(p.EnqueueTo(ctx, 0, []byte(`{}`), worker.WithHeader(nats.Header{"leasehold-kind": []string{"email\n;rm"}})))
	garbled := mustEnq(p.EnqueueTo(ctx, 0, []byte(`{"to":`), worker.WithKind("email")))
	mustEnq(worker.Enqueue(ctx, p, "email", email{To: "last"}))

	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.MaxAttempts = 100 // dead-lettering must not wait for attempts to run out
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the last job", func() bool {
		_, ok := ran.Load("last")
		return ok && rec.count(kind(worker.EventJobDeadLettered)) == 4
	})
	if _, ok := ran.Load("first"); !ok {
		t.Fatal("the first job did not run")
	}
	if n := rec.count(kind(worker.EventJobStarted)); n != 6 {
		t.Fatalf("%d attempts for 6 jobs: an unknown kind must not be retried", n)
	}
	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 4 {
		t.Fatalf("%d dead letters, want 4", len(dlq))
	}
	want := map[uint64][]string{
		unknown.Seq:  {`kind "sms"`, "no handler serves the job's kind", "serves kinds email"},
		unkinded.Seq: {"no Leasehold-Kind header"},
		forged.Seq:   {"job kind", "use letters, digits"},
		garbled.Seq:  {"does not decode as worker_test.email"},
	}
	for _, m := range dlq {
		seq, _ := strconv.ParseUint(m.Headers().Get(worker.HeaderSeq), 10, 64)
		reason := m.Headers().Get(worker.HeaderError)
		if m.Headers().Get(worker.HeaderAttempts) != "1" {
			t.Errorf("dead letter of %d after %s attempts", seq, m.Headers().Get(worker.HeaderAttempts))
		}
		for _, w := range want[seq] {
			if !strings.Contains(reason, w) {
				t.Errorf("dead letter of job %d says %q, want it to say %q", seq, reason, w)
			}
		}
		delete(want, seq)
		if seq == unknown.Seq && m.Headers().Get(worker.HeaderKind) != "sms" {
			t.Errorf("the dead letter lost the job's kind: %v", m.Headers())
		}
	}
	if len(want) != 0 {
		t.Fatalf("no dead letter for %v", want)
	}
}

// A job stream that schedules allows roll-ups (the server requires it), so
// a message with Nats-Rollup on a job subject purges the partition's jobs
// before it. The producer refuses to send one, and a Mux dead-letters one
// that arrives, saying what happened, so that it does not go unseen.
func TestRollupOnAJobSubjectIsRefusedAndReported(t *testing.T) {
	e := newEnv(t, 1)
	p := e.producer(t)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.WithHeader(nats.Header{"Nats-Rollup": []string{"sub"}})); err == nil || !strings.Contains(err.Error(), "server directive") {
		t.Fatalf("an enqueue with a Nats-Rollup header: %v", err)
	}
	for range 3 {
		if _, err := worker.Enqueue(ctx, p, "email", email{To: "lost"}); err != nil {
			t.Fatal(err)
		}
	}
	forged := &nats.Msg{Subject: worker.JobSubject(e.prefix, 0), Data: []byte(`{}`), Header: nats.Header{"Nats-Rollup": []string{"sub"}, worker.HeaderKind: []string{"email"}}}
	if _, err := e.js.PublishMsg(ctx, forged); err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, worker.JobsStream(e.prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(worker.JobSubject(e.prefix, 0)))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("jobs left on the partition after a forged roll-up: %d of 4", info.State.Subjects[worker.JobSubject(e.prefix, 0)])

	mux := worker.NewMux()
	var ran sync.Map
	worker.Handle(mux, "email", func(ctx context.Context, j *worker.Job, m email) error {
		ran.Store(j.Seq, true)
		return nil
	})
	rec := newRecorder()
	cfg := e.config("w", mux)
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "the forged job to be dead-lettered", func() bool { return rec.count(kind(worker.EventJobDeadLettered)) == 1 })
	dlq := deadLetters(t, e)
	if len(dlq) != 1 || !strings.Contains(dlq[0].Headers().Get(worker.HeaderError), "carries a Nats-Rollup header: the server purged every job stored before it") {
		t.Fatalf("dead letters %d, the first saying %q", len(dlq), dlq[0].Headers().Get(worker.HeaderError))
	}
}
