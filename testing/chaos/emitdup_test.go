package chaos

import (
	"context"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A zombie's effect published through Job.Emit reaches the effect log
// behind its successor's barrier, and before the successor re-runs the
// job. The in-order sink refuses it as stale — right. When the message ID
// was the idempotency key alone, the log then dropped the successor's
// write of the same key as a duplicate and acknowledged it: the successor
// committed past the job and its effect was never applied. The message ID
// now carries the epoch (worker.MessageID); this test keeps it that way.
//
// The chaos harness's write-behind workers publish without a Nats-Msg-Id
// and do not meet this; the SDK's own Emit path does. Found by reading
// the effect log's dedupe against the chaos histories; reproduced here
// with a frozen connection, which is what a paused process or a network
// partition looks like from outside.
func TestZombieEmitDoesNotHideItsSuccessorsEffect(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const pfx = "emitdup"
	srv := natstest.Start(t, natstest.Listen())
	js := srv.JetStream(t)
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: pfx + "-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: pfx, Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// The sink: the in-order runner fencing the log, a deduping memory
	// sink behind it.
	applied := sink.NewMemory(sink.MemoryConfig{Logger: quiet})
	runner, err := streamsink.New(ctx, js, streamsink.Config{Prefix: pfx, Logger: quiet,
		Handler: func(ctx context.Context, e sink.Effect) error { e.Subject = e.Stamp.Key; return applied.Apply(ctx, e) }})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stopRunner := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- runner.Run(runCtx) }()
	defer func() { stopRunner(); <-runDone }()

	prod, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: pfx, Partitions: 1})
	if err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for i := range 3 {
		e, err := prod.EnqueueTo(ctx, 0, []byte{byte(i)})
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, e.Seq)
	}
	target := seqs[1]
	key := leasehold.EffectKey(pfx, 0, target, 0)

	// Worker A reaches NATS through a proxy the test freezes just before
	// A emits the target job's effect.
	px := newFreezer(t, srv.URL()[len("nats://"):])
	ncA, err := nats.Connect(px.url(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer ncA.Close()
	jsA, _ := jetstream.New(ncA)
	bucketA, err := coordinator.OpenBucket(ctx, jsA, pfx+"-leases")
	if err != nil {
		t.Fatal(err)
	}
	frozen := make(chan struct{})
	var once sync.Once
	a := startWorker(t, worker.Config{JetStream: jsA, Prefix: pfx, Partitions: 1, Bucket: bucketA, Logger: quiet, CommitEvery: time.Hour,
		Coordinator: coordinator.Config{Worker: "a", TTL: time.Second},
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			if j.Seq == target {
				once.Do(func() { px.freeze(); close(frozen) })
			}
			return j.Emit(ctx, j.Data) // for the target: sent into the frozen connection, lease still valid
		})})
	defer a()
	select {
	case <-frozen:
	case <-ctx.Done():
		t.Fatal("A never reached the target job")
	}

	// Worker B takes the partition over once A's lease expires, and holds
	// its re-run of the target job until the zombie's write is refused.
	release := make(chan struct{})
	b := startWorker(t, worker.Config{JetStream: js, Prefix: pfx, Partitions: 1, Bucket: bucket, Logger: quiet,
		Coordinator: coordinator.Config{Worker: "b", TTL: time.Second},
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			if j.Seq == target {
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return j.Emit(ctx, j.Data)
		})})
	defer b()
	for runner.Fence(leasehold.FenceID{Scope: pfx}).Epoch == 0 || leaseHolder(ctx, bucket) != "b" {
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			t.Fatal("B never took the partition over")
		}
	}
	// B's barrier is in the log (the runner raised the fence to B's
	// epoch); now A's frozen effect arrives behind it.
	bEpoch := leaseEpoch(ctx, bucket)
	for runner.Fence(leasehold.FenceID{Scope: pfx}).Epoch < bEpoch {
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			t.Fatal("the sink never saw B's barrier")
		}
	}
	px.thaw()
	for runner.Dropped(leasehold.FenceID{Scope: pfx}) == 0 {
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			t.Fatal("A's late effect never reached the sink")
		}
	}
	close(release)

	// Every job's effect must be applied once B has handled them all.
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, ok := applied.Get(key)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			log, _ := readEffectLog(ctx, js, pfx)
			for _, l := range log {
				if l.Stamp.Key == key {
					t.Logf("effect log position %d: key %s epoch %d worker %s (A's epoch: the only copy)", l.Position, l.Stamp.Key, l.Stamp.Epoch, l.Stamp.Worker)
				}
			}
			t.Fatalf("job %d's effect %s was never applied: A's refused write, stored in the effect log under Nats-Msg-Id %q, made the log drop B's write of the same key as a duplicate", target, key, key)
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
}

func leaseHolder(ctx context.Context, b *coordinator.Bucket) string {
	st, err := b.Snapshot(ctx)
	if err != nil || len(st.Partitions) == 0 {
		return ""
	}
	return st.Partitions[0].Holder
}

func leaseEpoch(ctx context.Context, b *coordinator.Bucket) leasehold.Epoch {
	st, err := b.Snapshot(ctx)
	if err != nil || len(st.Partitions) == 0 {
		return 0
	}
	return st.Partitions[0].Epoch
}

// startWorker runs a worker until the returned stop is called.
func startWorker(t *testing.T, cfg worker.Config) (stop func()) {
	t.Helper()
	w, err := worker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	return func() { cancel(); <-done }
}

// freezer forwards TCP connections and can stop their bytes both ways
// without closing anything: a paused process, seen from outside.
type freezer struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	cond   *sync.Cond
	frozen bool
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newFreezer(t *testing.T, target string) *freezer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &freezer{ln: ln, target: target}
	f.cond = sync.NewCond(&f.mu)
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			f.mu.Lock()
			f.conns = append(f.conns, c, s)
			f.mu.Unlock()
			f.wg.Add(2)
			go f.pipe(s, c)
			go f.pipe(c, s)
		}
	}()
	t.Cleanup(func() {
		f.thaw()
		ln.Close()
		f.mu.Lock()
		for _, c := range f.conns {
			c.Close()
		}
		f.mu.Unlock()
		f.wg.Wait()
	})
	return f
}

func (f *freezer) url() string { return "nats://" + f.ln.Addr().String() }
func (f *freezer) freeze()     { f.set(true) }
func (f *freezer) thaw()       { f.set(false) }

func (f *freezer) set(v bool) {
	f.mu.Lock()
	f.frozen = v
	f.cond.Broadcast()
	f.mu.Unlock()
}

func (f *freezer) pipe(dst, src net.Conn) {
	defer f.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		f.mu.Lock()
		for f.frozen {
			f.cond.Wait()
		}
		f.mu.Unlock()
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
