package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// fetcher reads one partition's jobs, in order, into out. It pulls with a
// Fetch loop on an ephemeral consumer that starts at a given sequence and
// acks nothing (progress is the lease's, not the consumer's); the next
// Fetch is sent as soon as the previous batch is handed over, so a batch is
// always in hand. It does not use Consume: in nats.go v1.55 a refill that
// falls due while a pull request is being sent is skipped, and a consumer
// with a backlog stalls until the heartbeat check fires. When anything
// looks wrong (an error, a missed heartbeat, a gap in the delivery
// sequence) it drops the consumer and creates a new one at the next
// sequence it needs, which also covers a server restart that forgot the
// consumer.
type fetcher struct {
	r      *runner
	out    chan jetstream.Msg
	cancel context.CancelFunc
	done   chan struct{}
}

// errGap reports a message the consumer skipped.
var errGap = errors.New("delivery sequence gap")

func (r *runner) startFetch(from uint64) *fetcher {
	ctx, cancel := context.WithCancel(r.ctx)
	f := &fetcher{r: r, out: make(chan jetstream.Msg, r.w.cfg.FetchBatch), cancel: cancel, done: make(chan struct{})}
	go f.run(ctx, from)
	return f
}

// stop ends the fetcher and waits for it; jobs it read and nobody took are
// dropped (they are read again from the progress the next holder resumes
// at).
func (f *fetcher) stop() {
	f.cancel()
	<-f.done
}

func (f *fetcher) run(ctx context.Context, from uint64) {
	defer close(f.done)
	cfg := &f.r.w.cfg
	next := from
	for failures := 0; ctx.Err() == nil; {
		if failures > 0 {
			if sleep(ctx, min(50*time.Millisecond<<min(failures-1, 6), 2*time.Second)) != nil {
				return
			}
		}
		cons, err := cfg.JetStream.CreateConsumer(ctx, JobsStream(cfg.Prefix), jetstream.ConsumerConfig{
			Description:       fmt.Sprintf("leasehold worker %s, partition %d, epoch %d", f.r.info.Holder, f.r.p, f.r.info.Epoch),
			DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:       next,
			AckPolicy:         jetstream.AckNonePolicy,
			FilterSubject:     f.r.subject,
			MemoryStorage:     true,
			Replicas:          1,
			InactiveThreshold: time.Minute,
		})
		if err != nil {
			if ctx.Err() == nil {
				failures++
				log := f.r.log.Debug
				if failures%20 == 5 {
					log = f.r.log.Warn // not a blip: say so, now and then
				}
				log("create job consumer failed; retrying", "from", next, "attempt", failures, "err", err)
			}
			continue
		}
		start := next
		next, err = f.pull(ctx, cons, next)
		f.r.deleteConsumer(cons)
		if ctx.Err() != nil {
			return
		}
		if next > start {
			failures = 0
		}
		failures++
		f.r.log.Debug("job consumer ended; starting a new one", "from", next, "err", err)
	}
}

// pull fetches batches from cons until something goes wrong, handing each
// message to out; it returns the next sequence to read.
func (f *fetcher) pull(ctx context.Context, cons jetstream.Consumer, next uint64) (uint64, error) {
	cfg := &f.r.w.cfg
	opts := func(fctx context.Context) []jetstream.FetchOpt {
		o := []jetstream.FetchOpt{jetstream.FetchContext(fctx)}
		if cfg.FetchWait >= time.Second {
			o = append(o, jetstream.FetchHeartbeat(cfg.FetchWait/5))
		}
		return o
	}
	var delivered uint64
	for {
		fctx, cancel := context.WithTimeout(ctx, cfg.FetchWait)
		batch, err := cons.Fetch(cfg.FetchBatch, opts(fctx)...)
		if err != nil {
			cancel()
			return next, err
		}
		n, pending := 0, uint64(0)
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				cancel()
				return next, fmt.Errorf("job metadata: %w", err)
			}
			if md.Sequence.Consumer != delivered+1 {
				cancel()
				return next, fmt.Errorf("%w: expected delivery %d, got %d", errGap, delivered+1, md.Sequence.Consumer)
			}
			delivered++
			n++
			pending = md.NumPending
			if md.Sequence.Stream < next {
				continue // already handed over
			}
			next = md.Sequence.Stream + 1
			select {
			case f.out <- m:
			case <-ctx.Done():
				cancel()
				return next, ctx.Err()
			}
		}
		cancel()
		if ctx.Err() != nil {
			return next, ctx.Err()
		}
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return next, err
		}
		if n == 0 {
			f.r.touch() // nothing waits: the partition is caught up
		}
		if n > 0 && n < cfg.FetchBatch && pending > 0 {
			// The request ended while jobs were waiting: it expired instead
			// of being filled. Count it, so that a stall cannot hide.
			f.r.w.stalls.Add(1)
			f.r.log.Warn("a pull request expired while jobs were waiting", "pending", pending, "received", n)
		}
	}
}

// deleteConsumer removes an ephemeral consumer this runner is done with.
// The server would remove it after its inactivity threshold anyway.
func (r *runner) deleteConsumer(cons jetstream.Consumer) {
	js := r.w.cfg.JetStream
	if !js.Conn().IsConnected() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = js.DeleteConsumer(ctx, JobsStream(r.w.cfg.Prefix), cons.CachedInfo().Name)
}
