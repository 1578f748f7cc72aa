package worker_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/worker"
)

// stallCountingJS is the worker's connection, with the number of async
// publishes made while counting is set.
type stallCountingJS struct {
	jetstream.JetStream
	counting atomic.Bool
	calls    atomic.Int64
}

func (c *stallCountingJS) PublishMsgAsync(m *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	if c.counting.Load() {
		c.calls.Add(1)
	}
	return c.JetStream.PublishMsgAsync(m, opts...)
}

// An effect that finds the client's pending publishes at their limit waits
// for room: at least EffectTimeout, then as long as its context and the
// lease last, looking at them between waits. An EffectTimeout far shorter
// than the client's stall wait must bound the first wait only: waits of
// that length after it make the loop spin on the publish, one try per
// EffectTimeout for as long as the stall lasts, on every job that waits,
// when the machine is busiest. Here the stall lasts the attempt's whole
// HandleTimeout (one second); the loop may look at the context and the
// lease a few times a second, not hundreds.
func TestAttackRoundTinyEffectTimeoutDoesNotSpinOnAStall(t *testing.T) {
	e := newEnv(t, 1)
	nc := e.srv.Connect(t)
	limited, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(1))
	if err != nil {
		t.Fatal(err)
	}
	js := &stallCountingJS{JetStream: limited}
	// A subscriber that answers the publish holding the only pending slot
	// only when told: the stall lasts until then.
	hold, err := nc.SubscribeSync("attack-round.hold")
	if err != nil {
		t.Fatal(err)
	}
	enq := e.enqueue(t, 0, 1)
	type result struct {
		calls int64
		err   error
	}
	first := make(chan result, 1)
	var attempts atomic.Int64
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if attempts.Add(1) > 1 {
			return j.Emit(ctx, j.Data)
		}
		if _, err := limited.PublishMsgAsync(&nats.Msg{Subject: "attack-round.hold", Data: []byte("x")}); err != nil {
			first <- result{err: err}
			return err
		}
		// The first effect is held until the next on its subject sends it.
		err := j.Emit(ctx, j.Data)
		if err == nil {
			js.counting.Store(true)
			err = j.Emit(ctx, j.Data)
			js.counting.Store(false)
		}
		first <- result{calls: js.calls.Load(), err: err}
		// The stall ends: the held publish is answered.
		if m, nerr := hold.NextMsg(10 * time.Second); nerr == nil {
			_ = m.Respond([]byte(`{"stream":"HOLD","seq":1}`))
		}
		if err == nil {
			err = errors.New("the effect was stored during the stall")
		}
		return err
	}))
	cfg.JetStream = js
	cfg.EffectTimeout = time.Millisecond
	cfg.HandleTimeout = time.Second
	start(t, cfg)
	var res result
	select {
	case res = <-first:
	case <-time.After(time.Minute):
		t.Fatal("the first attempt did not end within a minute")
	}
	if res.err == nil {
		t.Fatalf("the effect of job %d was stored while the only pending slot was held", enq[0].Seq)
	}
	t.Logf("the stalled effect ended with %v after %d publishes", res.err, res.calls)
	// One publish waits EffectTimeout, each after it the client's 200 ms:
	// about six in the second the stall lasts. Load makes them fewer.
	if res.calls > 20 {
		t.Fatalf("a stall of one second took %d publishes: the wait for room spins at EffectTimeout (%v) per try", res.calls, cfg.EffectTimeout)
	}
}

// A handler whose context ends while its effect waits for room returns
// then: the wait looks at the context between the client's stall waits.
// An EffectTimeout longer than HandleTimeout and HangGrace together (a
// slow cluster's) must not keep it waiting past its context's end until
// the worker takes it for hung, gives its partition up and counts a
// failure against a handler that did nothing wrong, on every job that
// waits for room when the server is slowest.
func TestAttackRoundStalledEffectEndsWithItsContext(t *testing.T) {
	e := newEnv(t, 1)
	nc := e.srv.Connect(t)
	limited, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(1))
	if err != nil {
		t.Fatal(err)
	}
	hold, err := nc.SubscribeSync("attack-round.hold")
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	e.enqueue(t, 0, 1)
	first := make(chan error, 1)
	var attempts atomic.Int64
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if attempts.Add(1) > 1 {
			return j.Emit(ctx, j.Data)
		}
		if _, err := limited.PublishMsgAsync(&nats.Msg{Subject: "attack-round.hold", Data: []byte("x")}); err != nil {
			first <- err
			return err
		}
		// The first effect is held until the next on its subject sends it.
		err := j.Emit(ctx, j.Data)
		if err == nil {
			err = j.Emit(ctx, j.Data)
		}
		first <- err
		if m, nerr := hold.NextMsg(10 * time.Second); nerr == nil {
			_ = m.Respond([]byte(`{"stream":"HOLD","seq":1}`))
		}
		if err == nil {
			err = errors.New("the effect was stored during the stall")
		}
		return err
	}))
	cfg.JetStream = limited
	cfg.Observer = rec
	cfg.EffectTimeout = 30 * time.Second
	cfg.HandleTimeout = 500 * time.Millisecond
	cfg.HangGrace = 3 * time.Second
	start(t, cfg)
	var res error
	select {
	case res = <-first:
	case <-time.After(time.Minute):
		t.Fatal("the first attempt did not end within a minute")
	}
	if res == nil {
		t.Fatal("the effect was stored while the only pending slot was held")
	}
	if n := rec.count(kind(worker.EventJobHung)); n > 0 {
		t.Fatalf("the handler was found hung %d times before its stalled effect returned (%v): the wait for room outlasted its context by HangGrace", n, res)
	}
	if !errors.Is(res, worker.ErrHandleTimeout) {
		t.Errorf("the stalled effect ended with %v, want the cause of its context's end, %v", res, worker.ErrHandleTimeout)
	}
}
