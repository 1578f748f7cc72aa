package streamsink_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/testing/sinktest"
)

// The tests wait on fetches, redeliveries and restarts far more than they
// compute, each on its own server: run more of them at once than the two
// a two-core machine gets by default. The tests that change a package
// limit (SetMaxAbove, SetMaxDelta) and the allocation tests stay
// sequential: they run before any parallel one starts.
func TestMain(m *testing.M) {
	testpar.Raise(4)
	testleak.VerifyTestMain(m)
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// positions records decisions by log position.
type positions struct {
	mu sync.Mutex
	ds map[uint64]sink.Decision
}

func (p *positions) Decided(_ context.Context, d sink.Decision) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ds == nil {
		p.ds = map[uint64]sink.Decision{}
	}
	p.ds[d.Position] = d
}

func (p *positions) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ds = nil
}

func (p *positions) at(seq uint64) (sink.Decision, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	d, ok := p.ds[seq]
	return d, ok
}

// running is a Runner with its Run goroutine.
type running struct {
	*streamsink.Runner
	cancel context.CancelFunc
	done   chan error
}

func start(t testing.TB, js jetstream.JetStream, cfg streamsink.Config) *running {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	r, err := streamsink.New(ctxFor(t, time.Minute), js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return run(t, r)
}

func run(t testing.TB, r *streamsink.Runner) *running {
	ctx, cancel := context.WithCancel(context.Background())
	rr := &running{Runner: r, cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	t.Cleanup(func() { rr.stop() })
	return rr
}

// stop ends Run and waits for it; it returns Run's error.
func (rr *running) stop() error {
	rr.cancel()
	err, ok := <-rr.done
	if ok {
		close(rr.done)
	}
	return err
}

// logSink presents an effect log and its runner as a sink.Sink, for the
// conformance suite: Apply publishes stamped effects into the log as a
// worker does and waits for the runner's decision.
type logSink struct {
	js     jetstream.JetStream
	r      *running
	rec    *positions
	prefix string
}

func (l *logSink) publish(ctx context.Context, subject string, h nats.Header, data []byte) error {
	ack, err := l.js.PublishMsg(ctx, &nats.Msg{Subject: subject, Header: h, Data: data})
	if err != nil {
		return err
	}
	if err := l.r.WaitPosition(ctx, ack.Sequence); err != nil {
		return err
	}
	if d, ok := l.rec.at(ack.Sequence); ok && d.Err != nil {
		return d.Err
	}
	return nil
}

func (l *logSink) Apply(ctx context.Context, effects ...sink.Effect) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	for _, e := range effects {
		h := nats.Header{}
		for k, v := range e.Header {
			h[k] = v
		}
		e.Stamp.SetHeader(h)
		if err := l.publish(ctx, e.Subject, h, e.Data); err != nil {
			return err
		}
	}
	return nil
}

// Advance publishes the barrier a worker publishes when it acquires l's
// partition, and waits for it to be decided. A barrier below the fence
// moves nothing and the runner reports nothing for it (a late barrier of
// an earlier acquisition is harmless); the adapter tells the caller so
// from the fence, as a worker reading the runner's fence would.
func (l *logSink) Advance(ctx context.Context, ls leasehold.Lease) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := sink.ValidateAdvance(ls); err != nil {
		return err
	}
	h := nats.Header{}
	st := ls.Stamp(leasehold.BarrierKey(ls.Scope, ls.Partition, ls.Epoch))
	st.SetHeader(h)
	h.Set(leasehold.HeaderBarrier, "1")
	if err := l.publish(ctx, l.prefix+".out.barrier", h, nil); err != nil {
		return err
	}
	f := l.r.Fence(ls.Fence())
	if v, _ := leasehold.Judge(f, st); v != leasehold.Admit {
		return leasehold.Refusal(f, st, v)
	}
	return nil
}

func (l *logSink) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	return l.r.Fence(id), ctx.Err()
}

func (l *logSink) Dropped(id leasehold.FenceID) uint64 { return l.r.Dropped(id) }

// downstream reads every message of the downstream stream as an effect.
func downstream(ctx context.Context, js jetstream.JetStream, name string) ([]sink.Effect, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []sink.Effect
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		st, err := leasehold.StampFromHeader(m.Header)
		if err != nil {
			return nil, fmt.Errorf("downstream message %d: %w", seq, err)
		}
		out = append(out, sink.Effect{Stamp: st, Subject: m.Subject, Data: m.Data, Header: m.Header})
	}
	return out, nil
}

// Each case's streams, consumers and buckets are named after it
// (Setup.Name), on one server: the cases run side by side, and beside the
// package's other tests once those, which run one at a time, are done.
func TestConformance(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	sinktest.Run(t, sinktest.Features{Durable: true, Dedupe: true, VerifiedEpochs: true, Headers: true, Parallel: true},
		func(t *testing.T, st sinktest.Setup) sinktest.Instance {
			rec := &positions{}
			js := srv.JetStream(t)
			cfg := streamsink.Config{Prefix: st.Name, Provision: true, Observer: sink.Observers{st.Observer, rec}, Verifier: st.Verifier, Logger: quiet()}
			l := &logSink{js: js, r: start(t, js, cfg), rec: rec, prefix: st.Name}
			return sinktest.Instance{
				Sink:    l,
				Subject: func(name string) string { return st.Name + ".out." + name },
				Applied: func(ctx context.Context) ([]sink.Effect, error) { return downstream(ctx, js, st.Name+"-fenced") },
				Reopen: func(ctx context.Context) (sink.Sink, error) {
					if err := l.r.stop(); err != nil {
						return nil, err
					}
					// The next reopen stops this runner: one runner reads
					// the log at a time.
					js2 := srv.JetStream(t)
					l = &logSink{js: js2, r: start(t, js2, cfg), rec: rec, prefix: st.Name}
					return l, nil
				},
				ApplyHeader: func(ctx context.Context, h map[string][]string, subject string, data []byte) error {
					return l.publish(ctx, subject, nats.Header(h), data)
				},
			}
		})
}
