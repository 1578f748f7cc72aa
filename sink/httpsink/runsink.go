package httpsink

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink/streamsink"
)

// sinkBatch is the runner's batch a relay takes when cfg sets none:
// smaller than a stream sink runner's default. A batch is saved and acked
// once its last request is answered, and requests are slow beside a
// store's writes: 100 of them, Concurrency at a time, stay well within
// the consumer's AckWait where 400 to a slow endpoint may not.
const sinkBatch = 100

// RunSink runs a stream sink runner under the relay's lock: one runner per
// term, built with cfg (its BatchHandler set to DeliverBatch, its Batch
// 100 unless cfg sets one), running until the term ends. Only the lock's
// holder consumes the effect log, so two relays never split its messages
// between them, and a relay that takes over starts from the progress its
// predecessor saved.
func (r *Relay) RunSink(ctx context.Context, js jetstream.JetStream, cfg streamsink.Config, opts ...SinkOption) error {
	cfg.Handler, cfg.BatchHandler = nil, r.DeliverBatch
	if cfg.Batch == 0 {
		cfg.Batch = sinkBatch
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("httpsink: invalid runner config: %w", err)
	}
	var o sinkOpts
	for _, opt := range opts {
		opt(&o)
	}
	return r.Run(ctx, func(ctx context.Context) error {
		for conflicts := 0; ; conflicts++ {
			rn, err := streamsink.New(ctx, js, cfg)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			if o.resumeGap > 0 {
				if err := rn.ResumeAfterGap(ctx, o.resumeGap); err != nil {
					return fmt.Errorf("httpsink: resume after the gap up to %d: %w", o.resumeGap, err)
				}
			}
			r.mu.Lock()
			r.runner = rn
			r.mu.Unlock()
			err = rn.Run(ctx)
			if !errors.Is(err, streamsink.ErrStateConflict) || ctx.Err() != nil {
				return err
			}
			// A relay that held the lock before saved progress after this
			// term loaded it (it was paused): start again from it.
			if conflicts >= 3 {
				return fmt.Errorf("httpsink: relay %s: the runner's progress was saved by another runner %d times in this term: does another process run the consumer %s without the lock? %w", r.cfg.Name, conflicts+1, cfg.Consumer, err)
			}
			r.log.Warn("httpsink: another runner saved progress under this consumer; loading it again", "consumer", cfg.Consumer, "err", err)
		}
	})
}

// SinkOption adjusts RunSink.
type SinkOption func(*sinkOpts)

type sinkOpts struct {
	resumeGap uint64
}

// ResumeAfterGap has each term's runner go past a gap in the effect log
// up to log position seq before it runs (streamsink.Runner.
// ResumeAfterGap): whatever the log lost there is given up. Harmless once
// the runner has passed seq.
func ResumeAfterGap(seq uint64) SinkOption { return func(o *sinkOpts) { o.resumeGap = seq } }
