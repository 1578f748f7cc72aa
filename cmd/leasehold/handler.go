package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// exampleEffect is what the example handler writes for each job.
type exampleEffect struct {
	Job       string `json:"job"`
	Partition uint32 `json:"partition"`
	Seq       uint64 `json:"seq"`
	Worker    string `json:"worker"`
	Epoch     uint64 `json:"epoch"`
	Input     string `json:"input"`
}

// exampleHandler is the handler `leasehold worker` runs: it spends
// workTime on each job and emits one effect to the partition's default
// output, where `leasehold sink` picks it up.
//
// With writeBehind it takes its stamp before the work and publishes the
// effect itself afterwards, as code that does its own I/O with a stamp it
// took earlier does. A process paused during the work wakes up and writes
// with its old epoch before it can notice the lease is gone: that is the
// zombie write the sinks exist to refuse, and the demo and the chaos
// harness use this mode to make one.
type exampleHandler struct {
	js          jetstream.JetStream
	prefix      string
	workTime    time.Duration
	writeBehind bool
	hist        *history.Writer
	// prop carries the job's trace context into write-behind effects, so a
	// sink's refusal joins the zombie's trace.
	prop propagation.TextMapPropagator
	// failFirst, above 0, picks one job in failFirst (by its ID) whose
	// first attempt emits two effects through the SDK and then fails; its
	// next attempt emits the one effect and succeeds. A sink must apply
	// nothing of the failed attempt: the chaos harness checks that.
	failFirst int
}

// errFailedOnPurpose fails the first attempt of a job failFirst picks.
var errFailedOnPurpose = errors.New("example handler: this attempt fails after emitting, on purpose (--fail-first-attempt)")

// picked reports whether failFirst picks the job.
func (h *exampleHandler) picked(job *worker.Job) bool {
	if h.failFirst <= 0 {
		return false
	}
	f := fnv.New32a()
	f.Write([]byte(job.ID))
	return f.Sum32()%uint32(h.failFirst) == 0
}

func (h *exampleHandler) Handle(ctx context.Context, job *worker.Job) error {
	if h.picked(job) {
		if err := h.work(ctx); err != nil {
			return err
		}
		if err := job.Emit(ctx, h.effect(job, job.Lease.Epoch)); err != nil {
			return err
		}
		if job.Attempt > 1 {
			return nil
		}
		// The first effect goes to the wire now, the second is held
		// back as the attempt's last; the failure sends an abort marker.
		if err := job.Emit(ctx, h.effect(job, job.Lease.Epoch)); err != nil {
			return err
		}
		return errFailedOnPurpose
	}
	if !h.writeBehind {
		if err := h.work(ctx); err != nil {
			return err
		}
		return job.Emit(ctx, h.effect(job, job.Lease.Epoch))
	}
	stamp, err := job.NextStamp()
	if err != nil {
		return err
	}
	h.hist.Record(history.Event{Kind: history.Start, Partition: uint32(stamp.Partition), Epoch: uint64(stamp.Epoch), Key: stamp.Key, Seq: job.Seq})
	_ = h.work(ctx) // a paused process does not see its context end
	msg := nats.NewMsg(worker.OutputSubject(h.prefix, job.Partition))
	stamp.SetHeader(msg.Header)
	if h.prop != nil {
		h.prop.Inject(ctx, telemetry.HeaderCarrier(msg.Header))
	}
	msg.Data = h.effect(job, stamp.Epoch)
	h.hist.Record(history.Event{Kind: history.Effect, Partition: uint32(stamp.Partition), Epoch: uint64(stamp.Epoch), Key: stamp.Key, Seq: job.Seq})
	// No Nats-Msg-Id: code doing its own I/O rarely sets one, and the
	// stream would then drop a zombie's write as a duplicate of its
	// successor's before any sink could see it. The sink dedupes by key.
	// A publish sent while the stream's leader fails over is never
	// answered: try again after 2 s instead of waiting out the whole 10 s
	// (a cluster run stalled a partition for 9 s so); a copy stored twice
	// is deduped by the sink.
	p := retry.Policy{For: 10 * time.Second, Attempt: 2 * time.Second}
	err = p.Do(context.WithoutCancel(ctx), func(ctx context.Context) error { _, err := h.js.PublishMsg(ctx, msg); return err })
	if err != nil {
		return fmt.Errorf("publish effect %s: %w", stamp.Key, err)
	}
	return nil
}

func (h *exampleHandler) work(ctx context.Context) error {
	if h.workTime <= 0 {
		return nil
	}
	select {
	case <-time.After(h.workTime):
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (h *exampleHandler) effect(job *worker.Job, e leasehold.Epoch) []byte {
	b, _ := json.Marshal(exampleEffect{
		Job:       job.ID,
		Partition: uint32(job.Partition),
		Seq:       job.Seq,
		Worker:    job.Lease.Holder,
		Epoch:     uint64(e),
		Input:     string(job.Data),
	})
	return b
}

// historyObserver records worker events for the chaos checker.
func historyObserver(w *history.Writer) worker.Observer {
	return worker.ObserverFunc(func(_ context.Context, e worker.Event) {
		ev := history.Event{Partition: uint32(e.Lease.Partition), Epoch: uint64(e.Lease.Epoch), Time: e.Time}
		switch e.Kind {
		case worker.EventPartitionAcquired:
			ev.Kind = history.Acquire
		case worker.EventPartitionLost:
			ev.Kind = history.Lose
			if e.Err != nil {
				ev.Reason = e.Err.Error()
			}
		case worker.EventPartitionDrained:
			ev.Kind = history.Release
		case worker.EventEffectEmitted:
			ev.Kind, ev.Key, ev.Epoch = history.Effect, e.Stamp.Key, uint64(e.Stamp.Epoch)
			if e.Job != nil {
				ev.Seq = e.Job.Seq
			}
		case worker.EventProgressCommitted:
			ev.Kind, ev.Seq = history.Commit, e.Seq
		case worker.EventJobFinished, worker.EventJobFailed, worker.EventJobHung:
			ev.Kind, ev.Seq, ev.Attempt, ev.Outcome = history.Attempt, e.Seq, e.WireAttempt, history.AttemptFailed
			if e.Kind == worker.EventJobFinished {
				ev.Outcome = history.AttemptCompleted
			}
		default:
			return
		}
		w.Record(ev)
	})
}
