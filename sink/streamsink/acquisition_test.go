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
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
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
	js, replicas := startTopo(t, topo)
	const prefix = "forgery"
	bucket := provisionJobs(t, js, prefix, replicas)
	fw := &forgeryWorld{js: js, prefix: prefix, decided: &decisions{}, applied: map[string]int{},
		forged: make(chan uint64, 1), events: make(chan worker.Event, 1024)}
	fw.sink = start(t, js, streamsink.Config{Prefix: prefix, Replicas: replicas, Handler: fw.handler, Verifier: bucket,
		Observer: fw.decided, MaxBackoff: 10 * time.Millisecond})
	cfg := workerConfig(js, prefix, bucket, "w1", emitEffectOf)
	cfg.Observer = fw
	runWorker(t, cfg)
	return fw
}

// A barrier forged with the holder's epoch and an acquisition of its own,
// published between the holder's acquisition and its own barrier, is
// refused as unverified: it does not raise the runner's fence, so the
// holder's barrier and every job the worker commits after it are applied.
// A runner that admitted it would refuse the holder's barrier and effects
// as a split brain while the worker commits them.
func TestForgedBarrierBeforeHolderIsRefused(t *testing.T) {
	t.Parallel()
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
			seqs := enqueueJobs(t, ctx, fw.js, fw.prefix, 5)
			// Every job is committed by the worker.
			awaitCommitted(t, ctx, fw.events, seqs[len(seqs)-1])
			settleLog(t, fw.js, fw.prefix, fw.sink)
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
