package worker_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// With packing, a caller's Nats-Msg-Id (EmitHeader) is replaced by the
// worker's, as without: an effect that fits with the worker's ID is
// stored, not refused as too large for carrying both in its count.
func TestPackedCallerMsgIDIsNotCounted(t *testing.T) {
	e := newEnv(t, 1)
	limit := e.js.Conn().MaxPayload()
	data := bytes.Repeat([]byte{'d'}, int(limit)-leasehold.SinkHeaderRoom-2048)
	callerID := strings.Repeat("i", 8<<10)
	errs := make(chan error, 16)
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		err := j.Emit(ctx, data, worker.EmitHeader(nats.Header{jetstream.MsgIDHeader: {callerID}}))
		errs <- err
		return err
	})
	cfg := e.packConfig("w", h)
	rec := newRecorder()
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	select {
	case err := <-errs:
		if err != nil {
			t.Fatalf("Emit: %v; want it taken: on the wire the effect carries the worker's Nats-Msg-Id only", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the handler did not run within a minute")
	}
	rec.waitCommitted(t, time.Minute, enq[0].Seq)
	msgs := effectLog(t, e)
	if len(msgs) != 1 || !bytes.Equal(msgs[0].data, data) {
		t.Fatalf("%d messages in the effect log, want the one effect", len(msgs))
	}
	if id := msgs[0].header.Get(jetstream.MsgIDHeader); id == callerID || !strings.HasPrefix(id, msgs[0].stamp.Key+"@") {
		t.Errorf("the effect's Nats-Msg-Id is %.40q, want the worker's", id)
	}
}

// Nor does a caller's Nats-Msg-Id split a pack that fits: two effects,
// each with one, that fit together with the worker's IDs leave as one
// packed message.
func TestPackedCallerMsgIDDoesNotSplitPack(t *testing.T) {
	e := newEnv(t, 1)
	limit := e.js.Conn().MaxPayload()
	callerID := strings.Repeat("i", 8<<10)
	data := bytes.Repeat([]byte{'d'}, int(limit-int64(leasehold.SinkHeaderRoom)-2*int64(len(callerID))-4096)/2)
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		for range 2 {
			if err := j.Emit(ctx, data, worker.EmitHeader(nats.Header{jetstream.MsgIDHeader: {callerID}})); err != nil {
				return err
			}
		}
		return nil
	})
	cfg := e.packConfig("w", h)
	rec := newRecorder()
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	rec.waitCommitted(t, time.Minute, enq[0].Seq)
	msgs := effectLog(t, e)
	if len(msgs) != 1 || msgs[0].pack != 2 {
		packs := make([]int, len(msgs))
		for i, m := range msgs {
			packs[i] = m.pack
		}
		t.Fatalf("%d messages in the effect log, packing %v effects (0: one alone), want one pack of 2", len(msgs), packs)
	}
}

// A handler that changes its Job.Lease, before an effect or after, does
// not change what the worker stamps the effect with: packed, its stamp is
// written when it leaves, after the handler returned.
func TestHandlerCannotChangeItsStamp(t *testing.T) {
	for _, pack := range []bool{false, true} {
		e := newEnv(t, 1)
		var want leasehold.Lease
		h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			want = j.Lease
			j.Lease.Epoch++
			if err := j.Emit(ctx, []byte("a")); err != nil {
				return err
			}
			j.Lease.Epoch++
			j.Lease.Holder = "someone-else"
			return j.Emit(ctx, []byte("b"))
		})
		cfg := e.config("w", h)
		cfg.PackEffects = pack
		rec := newRecorder()
		cfg.Observer = rec
		start(t, cfg)
		enq := e.enqueue(t, 0, 1)
		rec.waitCommitted(t, time.Minute, enq[0].Seq)
		for _, m := range effectLog(t, e) {
			if m.stamp.Epoch != want.Epoch || m.stamp.Worker != want.Holder || m.stamp.Acquisition != want.Acquisition {
				t.Errorf("PackEffects %v: an effect stamped epoch %d by %q, want the lease's: epoch %d by %q", pack, m.stamp.Epoch, m.stamp.Worker, want.Epoch, want.Holder)
			}
		}
	}
}
