package streamsink_test

import (
	"context"
	"errors"
	"fmt"
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

// forgeryWorld is a job stream of one partition, a worker handling it, and
// a stream sink runner that verifies epochs against the worker's lease
// bucket. When the worker is handed the partition, and before it writes
// its own barrier, a forger publishes a barrier into the effect log with
// the holder's epoch (anyone who reads the lease bucket knows it) and an
// acquisition of its own.
type forgeryWorld struct {
	js      jetstream.JetStream
	prefix  string
	sink    *running
	decided *decisions

	mu      sync.Mutex
	applied map[string]int
	forged  chan uint64 // the forged barrier's log position
	events  chan worker.Event
}

// decisions keeps every decision of the runner, by stamp key and outcome.
type decisions struct {
	mu sync.Mutex
	ds []sink.Decision
}

func (d *decisions) Decided(_ context.Context, x sink.Decision) {
	d.mu.Lock()
	d.ds = append(d.ds, x)
	d.mu.Unlock()
}

func (d *decisions) at(pos uint64) (sink.Decision, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, x := range d.ds {
		if x.Position == pos {
			return x, true
		}
	}
	return sink.Decision{}, false
}

func (fw *forgeryWorld) handler(_ context.Context, e sink.Effect) error {
	fw.mu.Lock()
	fw.applied[e.Stamp.Key]++
	fw.mu.Unlock()
	return nil
}

func (fw *forgeryWorld) WorkerEvent(ctx context.Context, e worker.Event) {
	if e.Kind == worker.EventPartitionAcquired {
		select {
		case fw.forged <- fw.forgeBarrier(ctx, e.Lease):
		default:
		}
	}
	select {
	case fw.events <- e:
	default:
	}
}

// forgeBarrier publishes a barrier with l's epoch and a forged
// acquisition to the worker's barrier subject, and returns its position
// (0 if it could not be published).
func (fw *forgeryWorld) forgeBarrier(ctx context.Context, l leasehold.Lease) uint64 {
	st := leasehold.Stamp{Scope: l.Scope, Partition: l.Partition, Epoch: l.Epoch, Acquisition: "forged", Key: leasehold.BarrierKey(l.Scope, l.Partition, l.Epoch), Worker: "forger"}
	h := nats.Header{}
	st.SetHeader(h)
	h.Set(leasehold.HeaderBarrier, "1")
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	ack, err := fw.js.PublishMsg(pctx, &nats.Msg{Subject: worker.OutputSubject(fw.prefix, l.Partition), Header: h})
	if err != nil {
		return 0
	}
	return ack.Sequence
}

func newForgeryWorld(t *testing.T, topo string) *forgeryWorld {
	t.Helper()
	var js jetstream.JetStream
	replicas := 1
	if topo == "cluster" {
		js, replicas = natstest.StartCluster(t).JetStream(t), 3
	} else {
		js = natstest.Start(t).JetStream(t)
	}
	const prefix = "forgery"
	ctx := ctxFor(t, time.Minute)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: 1, Replicas: replicas}); err != nil {
		t.Fatal(err)
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: prefix + "-leases", Replicas: replicas, MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fw := &forgeryWorld{js: js, prefix: prefix, decided: &decisions{}, applied: map[string]int{},
		forged: make(chan uint64, 1), events: make(chan worker.Event, 1024)}
	fw.sink = start(t, js, streamsink.Config{Prefix: prefix, Replicas: replicas, Handler: fw.handler, Verifier: bucket,
		Observer: fw.decided, MaxBackoff: 10 * time.Millisecond})
	w, err := worker.New(worker.Config{
		JetStream: js, Prefix: prefix, Partitions: 1, Bucket: bucket,
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			return j.Emit(ctx, []byte(fmt.Sprintf("effect of %s", j.Data)))
		}),
		Coordinator: coordinator.Config{Worker: "w1", TTL: 2 * time.Second, RebalanceDelay: 100 * time.Millisecond, Logger: quiet()},
		Backoff:     func(int) time.Duration { return 10 * time.Millisecond },
		Observer:    fw, Logger: quiet(),
	})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker Run: %v", err)
		}
	})
	return fw
}

// A barrier forged with the holder's epoch and an acquisition of its own,
// published between the holder's acquisition and its own barrier, is
// refused as unverified: it does not raise the runner's fence, so the
// holder's barrier and every job the worker commits after it are applied.
// A runner that admitted it would refuse the holder's barrier and effects
// as a split brain while the worker commits them.
func TestForgedBarrierBeforeHolderIsRefused(t *testing.T) {
	for _, topo := range []string{"single", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			fw := newForgeryWorld(t, topo)
			ctx := ctxFor(t, time.Minute)
			var forgedAt uint64
			select {
			case forgedAt = <-fw.forged:
			case <-ctx.Done():
				t.Fatal("the worker was not handed the partition within a minute")
			}
			if forgedAt == 0 {
				t.Fatal("the forged barrier could not be published")
			}
			p, err := worker.NewProducer(fw.js, worker.ProducerConfig{Prefix: fw.prefix, Partitions: 1})
			if err != nil {
				t.Fatal(err)
			}
			const jobs = 5
			var seqs []uint64
			for i := range jobs {
				e, err := p.Enqueue(ctx, []byte(fmt.Sprint(i)), []byte(fmt.Sprintf("job-%d", i)))
				if err != nil {
					t.Fatal(err)
				}
				seqs = append(seqs, e.Seq)
			}
			// Every job is committed by the worker.
			committed := uint64(0)
			for committed < seqs[len(seqs)-1] {
				select {
				case e := <-fw.events:
					if e.Kind == worker.EventProgressCommitted && e.Seq > committed {
						committed = e.Seq
					}
				case <-ctx.Done():
					t.Fatalf("the worker committed up to %d within a minute, want %d", committed, seqs[len(seqs)-1])
				}
			}
			s, err := fw.js.Stream(ctx, worker.EffectsStream(fw.prefix))
			if err != nil {
				t.Fatal(err)
			}
			info, err := s.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := fw.sink.WaitPosition(ctx, info.State.LastSeq); err != nil {
				t.Fatal(err)
			}
			d, ok := fw.decided.at(forgedAt)
			if !ok || d.Outcome != sink.Unverified || !errors.Is(d.Err, sink.ErrUnverifiedEpoch) {
				t.Errorf("the forged barrier at position %d was decided %v (%v), want unverified", forgedAt, d.Outcome, d.Err)
			}
			fw.mu.Lock()
			defer fw.mu.Unlock()
			for _, seq := range seqs {
				if k := fmt.Sprintf("%s.0.%d.0", fw.prefix, seq); fw.applied[k] != 1 {
					t.Errorf("the effect %s of committed job %d was applied %d times, want once (applied: %v)", k, seq, fw.applied[k], fw.applied)
				}
			}
		})
	}
}
