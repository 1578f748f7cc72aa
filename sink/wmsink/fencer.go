// Package wmsink fences Watermill messages: a HandlerMiddleware that runs
// a handler only for messages whose stamp (leasehold metadata) is not
// stale, from any Watermill subscriber.
//
// The Fencer keeps the maxima in a sink.Fence (sink.NewMemory for one
// process, or a durable sink such as kvsink or pgsink so that they survive
// restarts) and makes the check, the raise and the handler one critical
// section per fence (scope and partition). That is atomic when this Fencer is the only
// writer of the partition's destination, the usual shape of a consumer
// that reads an effect log in order. When several processes write the same
// destination, write through a Sink's Apply (or pgsink.ApplyTx) instead,
// whose check and write are atomic in the store.
//
// A stale message is acked and dropped: the middleware reports it (with
// its *leasehold.StaleEpochError) to the Observer, counts and logs it, and
// returns no error, so it is never redelivered. A message with missing or
// malformed leasehold metadata gets an error that matches
// leasehold.ErrBadStamp and names the field; Watermill nacks it, so put
// middleware.PoisonQueue outside this middleware to move such messages
// aside. A barrier message (leasehold.HeaderBarrier in its metadata)
// raises the partition's maximum and is acked without calling the handler.
package wmsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// Config configures a Fencer.
type Config struct {
	// Fence keeps the fences. Required.
	Fence sink.Fencer
	// Name names the sink in decisions and logs. Default "watermill".
	Name string
	// Verifier, when set, turns on verified epochs (see sink.EpochCheck).
	Verifier sink.Verifier
	// Observer receives every decision. Optional.
	Observer sink.Observer
	// Logger receives rate-limited drop lines. Default slog.Default().
	Logger *slog.Logger
	// Telemetry selects the providers of the Fencer's spans and metrics: a
	// consumer span "process <topic>" for each message, the child of the
	// span that published it (from the trace context in its metadata).
	// Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

// Fencer fences messages against the fences in a sink.Fencer.
type Fencer struct {
	fence sink.Fencer
	rep   *sink.Reporter
	check *sink.EpochCheck

	mu    sync.Mutex
	locks map[leasehold.FenceID]*sync.Mutex
}

// New returns a Fencer.
func New(cfg Config) (*Fencer, error) {
	if cfg.Fence == nil {
		return nil, errors.New("wmsink: Config.Fence is required: pass sink.NewMemory(...) or a durable sink")
	}
	if cfg.Name == "" {
		cfg.Name = "watermill"
	}
	return &Fencer{
		fence: cfg.Fence,
		rep:   sink.NewReporter(sink.ReporterConfig{Name: cfg.Name, Observer: cfg.Observer, Logger: cfg.Logger, Telemetry: cfg.Telemetry}),
		check: sink.NewEpochCheck(cfg.Verifier),
		locks: make(map[leasehold.FenceID]*sync.Mutex),
	}, nil
}

// Dropped returns how many messages of fence id were refused.
func (f *Fencer) Dropped(id leasehold.FenceID) uint64 { return f.rep.Dropped(id) }

func (f *Fencer) lock(id leasehold.FenceID) *sync.Mutex {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.locks[id]
	if l == nil {
		l = &sync.Mutex{}
		f.locks[id] = l
	}
	return l
}

// Fence runs apply if the stamp in metadata md is admitted, holding the
// partition's critical section across the check, the raise and apply. It
// returns a *leasehold.StaleEpochError for a stale stamp, an error matching
// leasehold.ErrBadStamp for bad metadata, one matching
// sink.ErrUnverifiedEpoch for a forged epoch, and apply's error. A barrier
// raises the maximum and does not call apply.
func (f *Fencer) Fence(ctx context.Context, md map[string]string, apply func() error) error {
	return f.fenceCtx(ctx, md, func(context.Context) error { return apply() })
}

// fenceCtx is Fence, calling apply with the context of the message's span.
func (f *Fencer) fenceCtx(ctx context.Context, md map[string]string, apply func(context.Context) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("wmsink: %w", err)
	}
	st, err := leasehold.StampFromMetadata(md)
	ctx, span := f.rep.StartProcess(ctx, telemetry.MetadataCarrier(md), message.SubscribeTopicFromCtx(ctx), st)
	defer span.End()
	if err != nil {
		err = fmt.Errorf("wmsink: message metadata: %w", err)
		f.rep.Report(ctx, sink.Decision{Outcome: sink.BadStamp, Stamp: st, Err: err})
		return err
	}
	barrier := isBarrier(md)
	id := st.Fence()
	l := f.lock(id)
	l.Lock()
	defer l.Unlock()
	fs, err := f.fence.Fence(ctx, id)
	if err != nil {
		return f.failed(ctx, st, fmt.Errorf("wmsink: read the fence of %s: %w", id, err))
	}
	max := fs.Epoch
	v, raise := leasehold.Judge(fs, st)
	if v != leasehold.Admit {
		if barrier && v == leasehold.Stale {
			return nil // a late barrier of an earlier acquisition
		}
		serr := leasehold.Refusal(fs, st, v)
		f.rep.Report(ctx, sink.Decision{Outcome: sink.Refused(v), Stamp: st, Max: max, MaxAcquisition: fs.Acquisition, Holder: fs.Holder, Err: serr})
		return serr
	}
	if raise {
		if err := f.check.Check(ctx, st); err != nil {
			o := sink.Failed
			if errors.Is(err, sink.ErrUnverifiedEpoch) {
				o = sink.Unverified
			}
			f.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: st, Max: max, Err: err})
			return err
		}
		// Raise before applying: if apply fails, the epoch was still
		// admitted, and no older message may pass after this one.
		l := leasehold.Lease{Scope: st.Scope, Partition: st.Partition, Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: st.Worker}
		if err := f.fence.Advance(ctx, l); err != nil {
			return f.failed(ctx, st, fmt.Errorf("wmsink: raise the fence of %s: %w", id, err))
		}
	}
	if barrier {
		if st.Epoch > max {
			f.rep.Report(ctx, sink.Decision{Outcome: sink.Advanced, Stamp: st, Max: st.Epoch})
		}
		return nil
	}
	if err := apply(ctx); err != nil {
		return f.failed(ctx, st, err)
	}
	f.rep.Report(ctx, sink.Decision{Outcome: sink.Accepted, Stamp: st, Max: st.Epoch})
	return nil
}

func (f *Fencer) failed(ctx context.Context, st leasehold.Stamp, err error) error {
	f.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: st, Err: err})
	return err
}

func isBarrier(md map[string]string) bool {
	if _, ok := md[leasehold.HeaderBarrier]; ok {
		return true
	}
	for k := range md {
		if strings.EqualFold(k, leasehold.HeaderBarrier) {
			return true
		}
	}
	return false
}

// dropped reports whether err means the message is refused for good.
func dropped(err error) bool {
	return errors.Is(err, leasehold.ErrStaleEpoch) || errors.Is(err, sink.ErrUnverifiedEpoch)
}
