package streamsink_test

import (
	"context"
	"encoding/json"
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

// recordForger plays a credential that may write the fence-record bucket
// and publish effects (a worker's). When the worker is handed the
// partition, before it writes its barrier, it rewrites the partition's
// fence record to name an acquisition of its own at the holder's epoch,
// publishes a barrier with that epoch and acquisition, waits until the
// runner has decided it, and puts the record back as it was.
type recordForger struct {
	js      jetstream.JetStream
	bucket  *coordinator.Bucket
	prefix  string
	decided *attackDecisions
	events  chan worker.Event

	once     sync.Once
	forgedAt chan uint64
	err      chan error
}

// attackDecisions keeps the runner's decisions by log position.
type attackDecisions struct {
	mu  sync.Mutex
	at  map[uint64]sink.Decision
	new chan struct{}
}

func (d *attackDecisions) Decided(_ context.Context, x sink.Decision) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.at[x.Position]; !ok {
		d.at[x.Position] = x
	}
	select {
	case d.new <- struct{}{}:
	default:
	}
}

func (d *attackDecisions) wait(ctx context.Context, pos uint64) (sink.Decision, bool) {
	for {
		d.mu.Lock()
		x, ok := d.at[pos]
		d.mu.Unlock()
		if ok {
			return x, true
		}
		select {
		case <-ctx.Done():
			return sink.Decision{}, false
		case <-d.new:
		}
	}
}

func (f *recordForger) WorkerEvent(ctx context.Context, e worker.Event) {
	if e.Kind == worker.EventPartitionAcquired {
		f.once.Do(func() {
			pos, err := f.forge(e.Lease)
			f.forgedAt <- pos
			f.err <- err
		})
	}
	select {
	case f.events <- e:
	default:
	}
}

func (f *recordForger) forge(l leasehold.Lease) (uint64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	key := "partition." + l.Partition.String()
	orig, err := f.bucket.FenceRecords().Get(ctx, key)
	if err != nil {
		return 0, fmt.Errorf("read the fence record: %w", err)
	}
	var rec map[string]any
	if err := json.Unmarshal(orig.Value(), &rec); err != nil {
		return 0, err
	}
	rec["acquisition"] = "forgedacquisition"
	if acqs, ok := rec["acquisitions"].([]any); ok && len(acqs) > 0 {
		acqs[len(acqs)-1] = "forgedacquisition"
	}
	forged, _ := json.Marshal(rec)
	if _, err := f.bucket.FenceRecords().Put(ctx, key, forged); err != nil {
		return 0, fmt.Errorf("rewrite the fence record: %w", err)
	}
	st := leasehold.Stamp{Scope: l.Scope, Partition: l.Partition, Epoch: l.Epoch, Acquisition: "forgedacquisition",
		Key: leasehold.BarrierKey(l.Scope, l.Partition, l.Epoch), Worker: l.Holder}
	h := nats.Header{}
	st.SetHeader(h)
	h.Set(leasehold.HeaderBarrier, "1")
	ack, err := f.js.PublishMsg(ctx, &nats.Msg{Subject: worker.OutputSubject(f.prefix, l.Partition), Header: h})
	if err != nil {
		return 0, fmt.Errorf("publish the forged barrier: %w", err)
	}
	// The runner meets it while the record names the forged acquisition:
	// it decides it then, or (a runner that does not judge while the
	// buckets disagree) waits. Either way the record goes back soon.
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Second)
	f.decided.wait(wctx, ack.Sequence)
	wcancel()
	if _, err := f.bucket.FenceRecords().Put(ctx, key, orig.Value()); err != nil {
		return ack.Sequence, fmt.Errorf("put the fence record back: %w", err)
	}
	return ack.Sequence, nil
}

// A fence record rewritten for a moment to name a forged acquisition at
// the holder's epoch, and a barrier with that epoch and acquisition
// published before the holder's own: the runner must refuse the barrier
// (the lease bucket's live lease at that epoch names the holder's token),
// and every job the worker commits must be applied. A runner that
// verified the forged barrier by the rewritten record raises the fence to
// it and refuses the holder's barrier and effects as a split brain, while
// the worker, finding its own acquisition in the record again, commits.
func TestAttackFenceRecordRewrittenForAMoment(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	const prefix = "recforge"
	ctx := ctxFor(t, 2*time.Minute)
	bucket := provisionJobs(t, js, prefix, 1)
	var mu sync.Mutex
	applied := map[string]int{}
	decided := &attackDecisions{at: map[uint64]sink.Decision{}, new: make(chan struct{}, 1)}
	runner := start(t, js, streamsink.Config{Prefix: prefix, Verifier: bucket, Observer: decided, MaxBackoff: 10 * time.Millisecond,
		Handler: func(_ context.Context, e sink.Effect) error {
			mu.Lock()
			applied[e.Stamp.Key]++
			mu.Unlock()
			return nil
		}})
	f := &recordForger{js: js, bucket: bucket, prefix: prefix, decided: decided, events: make(chan worker.Event, 1024),
		forgedAt: make(chan uint64, 1), err: make(chan error, 1)}
	cfg := workerConfig(js, prefix, bucket, "w1", emitEffectOf)
	cfg.Observer = f
	defer runWorker(t, cfg)()
	var forgedAt uint64
	select {
	case forgedAt = <-f.forgedAt:
	case <-ctx.Done():
		t.Fatal("the worker was not handed the partition")
	}
	if err := <-f.err; err != nil {
		t.Fatal(err)
	}

	seqs := enqueueJobs(t, ctx, js, prefix, 5)
	awaitCommitted(t, ctx, f.events, seqs[len(seqs)-1])
	settleLog(t, js, prefix, runner)
	if d, _ := decided.wait(ctx, forgedAt); d.Outcome != sink.Unverified {
		t.Errorf("the forged barrier at position %d was decided %v (%v), want unverified", forgedAt, d.Outcome, d.Err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, seq := range seqs {
		if k := leasehold.EffectKey(prefix, 0, seq, 0); applied[k] != 1 {
			t.Errorf("job %d was committed and its effect %s applied %d times, want once", seq, k, applied[k])
		}
	}
}
