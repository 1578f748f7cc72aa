package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/internal/testskip"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

func TestMain(m *testing.M) {
	if fleet.IsChild() {
		// Started by the demo, the chaos harness or a benchmark as the
		// leasehold command: be it.
		main()
		os.Exit(0)
	}
	testpar.Raise(4)
	testleak.VerifyTestMain(testskip.Summarize(m))
}

// run executes the command line args and returns what it printed.
func run(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	root := newRoot()
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}

// startFleet runs n coordinators over partitions on s until the test ends.
func startFleet(t *testing.T, s *natstest.Server, n, partitions int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if err := worker.ProvisionJobs(ctx, s.JetStream(t), worker.JobsConfig{Prefix: "leasehold", Partitions: partitions}); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, s.JetStream(t), coordinator.BucketConfig{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{}, n)
	for i := range n {
		c, err := coordinator.New(b, coordinator.Config{Worker: "w" + string(rune('a'+i)), Partitions: partitions, TTL: 2 * time.Second,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		go func() { c.Run(ctx); done <- struct{}{} }()
	}
	t.Cleanup(func() {
		cancel()
		for range n {
			<-done
		}
	})
}

// fleets lets one test at a time run a fleet of processes of this (race-
// detecting) binary: a chaos run, the demo, a status page over frozen
// workers. Each fleet keeps both cores of a small machine busy, and its
// failovers are judged against lease TTLs; the tests that only call the
// command in this process run beside it.
var fleets = make(chan struct{}, 1)

// oneFleet waits for the fleet slot and returns the function that gives
// it back: call it as `defer oneFleet(t)()`, after t.Parallel.
func oneFleet(t *testing.T) func() {
	t.Helper()
	fleets <- struct{}{}
	return func() { <-fleets }
}

// fleetTest begins a test that starts a fleet: it is skipped under -short
// (why says what it would start), runs in parallel with the others, holds
// the fleet slot until it ends, and returns a context that ends after d or
// with the test.
func fleetTest(t *testing.T, why string, d time.Duration) context.Context {
	t.Helper()
	if testing.Short() {
		t.Skip(why)
	}
	t.Parallel()
	t.Cleanup(oneFleet(t))
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// listening starts a server the command reaches over loopback TCP, as it
// would a real one, and a context that ends after d or with the test.
func listening(t *testing.T, d time.Duration) (*natstest.Server, context.Context) {
	t.Helper()
	s := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return s, ctx
}

// initialized is listening, with `leasehold init` run against the server
// with args.
func initialized(t *testing.T, d time.Duration, args ...string) (*natstest.Server, context.Context) {
	t.Helper()
	s, ctx := listening(t, d)
	mustRun(t, ctx, append([]string{"init", "--nats", s.URL()}, args...)...)
	return s, ctx
}

func mustRun(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	out, err := run(t, ctx, args...)
	if err != nil {
		t.Fatalf("%v: %v\n%s", args, err, out)
	}
	return out
}

func wantIn(t *testing.T, what, out string, parts ...string) {
	t.Helper()
	for _, p := range parts {
		if !strings.Contains(out, p) {
			t.Errorf("%s lacks %q:\n%s", what, p, out)
		}
	}
}

// progress records the progress a worker commits, per partition, and
// lets a test wait for it.
type progress struct {
	mu      sync.Mutex
	seq     map[leasehold.Partition]uint64
	changed chan struct{}
}

func newProgress() *progress {
	return &progress{seq: map[leasehold.Partition]uint64{}, changed: make(chan struct{})}
}

func (p *progress) WorkerEvent(_ context.Context, e worker.Event) {
	if e.Kind != worker.EventProgressCommitted {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if e.Seq > p.seq[e.Lease.Partition] {
		p.seq[e.Lease.Partition] = e.Seq
		close(p.changed)
		p.changed = make(chan struct{})
	}
}

// wait returns once progress of partition part reaches seq: the job at
// seq is done, or its dead letter stored.
func (p *progress) wait(t *testing.T, ctx context.Context, part leasehold.Partition, seq uint64) {
	t.Helper()
	for {
		p.mu.Lock()
		got, changed := p.seq[part], p.changed
		p.mu.Unlock()
		if got >= seq {
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("progress of partition %d never reached job %d (it is at %d)", part, seq, got)
		}
	}
}

// runDLQWorker runs a worker with handler h on the job stream of prefix (made
// by `leasehold init`) until the test ends, dead-lettering a job after one
// failed attempt, and reports the progress it commits.
func runDLQWorker(t *testing.T, ctx context.Context, js jetstream.JetStream, prefix string, partitions int, h worker.HandlerFunc) *progress {
	t.Helper()
	bucket, err := coordinator.OpenBucket(ctx, js, prefix+"-leases")
	if err != nil {
		t.Fatal(err)
	}
	prog := newProgress()
	w, err := worker.New(worker.Config{
		JetStream: js, Prefix: prefix, Partitions: partitions, Bucket: bucket, MaxAttempts: 1, Handler: h,
		Coordinator: coordinator.Config{Worker: "w", TTL: 2 * time.Second},
		Observer:    prog,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	runTestWorker(t, w)
	return prog
}

// runTestWorker runs w until the test ends, then stops it and fails the test if
// Run returned an error.
func runTestWorker(t *testing.T, w *worker.Worker) {
	t.Helper()
	wctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(wctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-stopped; err != nil {
			t.Errorf("worker: %v", err)
		}
	})
}

// runTestSink runs the sink r until the test ends, then stops it and waits for
// it to return.
func runTestSink(t *testing.T, r interface{ Run(context.Context) error }) {
	t.Helper()
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() {
		stop()
		<-done
	})
}

// enqueueDone enqueues data to partition 0 of prefix's job stream and waits
// until prog shows the job done.
func enqueueDone(t *testing.T, ctx context.Context, js jetstream.JetStream, prefix string, partitions int, prog *progress, data []byte, opts ...worker.EnqueueOption) worker.Enqueued {
	t.Helper()
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: partitions})
	if err != nil {
		t.Fatal(err)
	}
	e, err := p.EnqueueTo(ctx, 0, data, opts...)
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 0, e.Seq)
	return e
}

// kvSinkHolding starts a listening server with a KV sink's bucket holding
// "v" at key, stamped as an effect of worker's on partition 0 at epoch 7.
func kvSinkHolding(t *testing.T, key, worker string) (*natstest.Server, context.Context, jetstream.JetStream) {
	t.Helper()
	s, ctx := listening(t, 60*time.Second)
	js := s.JetStream(t)
	if _, err := kvsink.New(ctx, js, kvsink.Config{Bucket: kvsink.DefaultBucket, Name: "kvs"}); err != nil {
		t.Fatal(err)
	}
	st := leasehold.Stamp{Scope: "leasehold", Partition: 0, Epoch: 7, Acquisition: "a1", Key: key, Worker: worker}
	h := nats.Header{}
	st.SetHeader(h)
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "$KV." + kvsink.DefaultBucket + "." + key, Data: []byte("v"), Header: h}); err != nil {
		t.Fatal(err)
	}
	return s, ctx, js
}

// waitSinkSettled waits until the stream sink runner r has decided the
// whole of prefix's effect log as it stands now.
func waitSinkSettled(t *testing.T, ctx context.Context, js jetstream.JetStream, prefix string, r *streamsink.Runner) {
	t.Helper()
	es, err := js.Stream(ctx, worker.EffectsStream(prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := es.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.WaitPosition(ctx, info.State.LastSeq); err != nil {
		t.Fatal(err)
	}
}

// notifyBuffer is a command's output that tells when a line matching re
// has been written.
type notifyBuffer struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	re    *regexp.Regexp
	match chan string // receives the first match's group, once
	sent  bool
}

func (b *notifyBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	if m := b.re.FindStringSubmatch(b.buf.String()); m != nil && !b.sent {
		b.match <- m[1]
		b.sent = true
	}
	return len(p), nil
}

func (b *notifyBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// startStatus runs `leasehold status` with args until the test ends and
// returns its page's address.
func startStatus(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	out := &notifyBuffer{re: regexp.MustCompile(`serving the status page at (http://\S+/)`), match: make(chan string, 1)}
	sctx, stop := context.WithCancel(ctx)
	root := newRoot()
	root.SetOut(out)
	root.SetErr(out)
	root.SetArgs(append([]string{"status"}, args...))
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(sctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("status --http: %v", err)
		}
	})
	select {
	case url := <-out.match:
		return url
	case err := <-done:
		done <- err
		t.Fatalf("status --http stopped (%v):\n%s", err, out)
	case <-ctx.Done():
		t.Fatalf("status --http never said where its page is:\n%s", out)
	}
	return ""
}

// waitStatus runs `leasehold status --json` with args until done accepts
// the status it prints, and returns that status. A run that fails or
// prints no status fails the test, and so does ctx ending first (what
// names the awaited state).
func waitStatus(t *testing.T, ctx context.Context, what string, done func(coordinator.Status) bool, args ...string) coordinator.Status {
	t.Helper()
	args = append([]string{"status", "--json"}, args...)
	cmd := strings.Join(args, " ")
	for {
		out, err := run(t, ctx, args...)
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
		var st coordinator.Status
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
		if done(st) {
			return st
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s never showed %s:\n%s", cmd, what, out)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
