package streamsink

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The runner's batch cycle is serial: decide, deliver, save the position,
// ack. Fetching need not be part of it. A prefetcher keeps one pull
// request open at all times and hands what arrives to Run's goroutine, so
// the next batch is in hand when the last one is acked, and a message that
// arrives mid-cycle waits for the rest of the cycle only, not for a fetch
// round trip (or two, when the log was quiet) after it.
//
// Fetching changes no state: the messages it holds are the consumer's
// deliveries, unacked, and a runner that dies holding them leaves them to
// be redelivered (after AckWait) or read from the log by the next one (see
// fill), as it leaves a batch it had fetched and not saved. It fetches one
// batch ahead and no more: a new pull starts only once the last one's
// messages are all taken, so a runner holds at most two batches unacked,
// and a successor has the rest of the consumer's MaxAckPending (four
// batches) while a dead runner's messages wait for AckWait.
//
// A Fetch loop rather than Consume: Consume can stall a consumer with a
// backlog until its heartbeat check fires.
type prefetcher struct {
	out  chan fetched
	stop context.CancelFunc
	done chan struct{}
	err  error // a fetch error met while a batch was taken, for the next take
	// taken is signalled when take empties out: the next pull may start.
	taken chan struct{}
	// nak, set before stop: hand what it holds back to the server.
	nak atomic.Bool
}

// fetched is one message, or the error of a failed fetch.
type fetched struct {
	m   *logMsg
	err error
}

// startPrefetch starts fetching; stop it with halt.
func (r *Runner) startPrefetch(ctx context.Context) *prefetcher {
	ctx, cancel := context.WithCancel(ctx)
	// A pull's messages and an error fit: the fetcher never blocks on a
	// send while its pull is open.
	p := &prefetcher{out: make(chan fetched, r.cfg.Batch+1), stop: cancel, done: make(chan struct{}), taken: make(chan struct{}, 1)}
	go func() {
		defer close(p.done)
		r.prefetch(ctx, p)
	}()
	return p
}

// prefetch fetches until ctx ends. A failed fetch is handed on, for Run to
// count, log and show in Ready, and tried again after a backoff.
func (r *Runner) prefetch(ctx context.Context, p *prefetcher) {
	failures := 0
	for ctx.Err() == nil {
		if len(p.out) > 0 {
			// One batch ahead: wait until the last pull's messages
			// (or its error) are taken.
			r.fetchHook("wait")
			select {
			case <-p.taken:
				continue
			case <-ctx.Done():
				return
			}
		}
		err := r.fetchInto(ctx, p)
		if err == nil {
			failures = 0
			continue
		}
		if ctx.Err() != nil {
			return
		}
		select {
		case p.out <- fetched{err: err}:
		case <-ctx.Done():
			return
		}
		failures++
		wait := min(r.cfg.MaxBackoff, 10*time.Millisecond<<min(failures, 10))
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// fetchInto runs one pull request of up to Config.Batch messages, open for
// up to Config.FetchWait, and hands each message on as it arrives.
//
// The pull outlives ctx while messages still come, up to stopGrace:
// ending it at once would drop the messages the server had sent it and the
// client had not read, and those would wait for AckWait, not be handed
// back, when the runner stops. (Once the pull's subscription is gone the
// server sends it nothing more.)
func (r *Runner) fetchInto(ctx context.Context, p *prefetcher) error {
	r.lastPull.Store(time.Now().UnixNano())
	if err := r.fetchHook("fetch"); err != nil {
		return fmt.Errorf("fetch from %s: %w", r.cfg.Stream, err)
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.FetchWait)
	defer cancel()
	var got atomic.Int64 // messages the pull brought
	defer context.AfterFunc(ctx, func() {
		// Stopped: read on while messages still come (ones the server
		// sent before the stop), ending the pull once none has come for
		// stopQuiet, and at stopGrace at most.
		grace := time.NewTimer(stopGrace)
		defer grace.Stop()
		quiet := time.NewTicker(stopQuiet)
		defer quiet.Stop()
		last := got.Load()
		for {
			select {
			case <-fctx.Done():
				return
			case <-grace.C:
				cancel()
				return
			case <-quiet.C:
				if n := got.Load(); n != last {
					last = n
					continue
				}
				cancel()
				return
			}
		}
	})()
	batch, err := r.cons.Fetch(r.cfg.Batch, jetstream.FetchContext(fctx))
	if err != nil {
		return fmt.Errorf("fetch from %s: %w", r.cfg.Stream, err)
	}
	n := 0
	for m := range batch.Messages() {
		meta, err := m.Metadata()
		if err != nil {
			continue
		}
		n++
		got.Add(1)
		select {
		case p.out <- fetched{m: &logMsg{seq: meta.Sequence.Stream, subject: m.Subject(), header: m.Headers(), data: m.Data(), msg: m}}:
		case <-ctx.Done():
			// Stopped: this message and the rest of the pull (which
			// ends once no message has come for stopQuiet) go back to
			// the server, or wait for AckWait.
			if p.nak.Load() {
				_ = m.Nak()
				for m := range batch.Messages() {
					_ = m.Nak()
				}
			}
			return nil
		}
	}
	if err := batch.Error(); err != nil && n == 0 && ctx.Err() == nil &&
		!errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, jetstream.ErrNoMessages) {
		return fmt.Errorf("fetch from %s: %w", r.cfg.Stream, err)
	}
	return nil
}

// A stopping runner reads the rest of an open pull until no message has
// come for stopQuiet, for stopGrace at most.
const (
	stopQuiet = 250 * time.Millisecond
	stopGrace = 2 * time.Second
)

// halt stops the prefetcher and waits for it, up to the end of an open
// pull (see fetchInto). With nak, the messages it holds are handed back to
// the server for redelivery at once (a runner that stops); without, they
// wait for AckWait, as a crashed runner's do.
func (p *prefetcher) halt(nak bool) {
	p.nak.Store(nak)
	p.stop()
	<-p.done
	for {
		select {
		case f := <-p.out:
			if nak && f.m != nil {
				_ = f.m.msg.Nak()
			}
		default:
			return
		}
	}
}

// take returns the next batch: it waits up to Config.FetchWait for one
// message and then takes whatever else has arrived, up to Config.Batch,
// so that a quiet log is handled at once and a busy one in full batches.
// A fetch error is returned once the messages before it are taken.
//
// Whatever take removes, a batch or an error, it signals the fetcher
// when it leaves nothing behind: the fetcher waits for that signal, and a
// take that missed it would leave the runner with nothing to fetch.
func (r *Runner) take(ctx context.Context, p *prefetcher) ([]*logMsg, error) {
	if err := p.err; err != nil {
		p.err = nil
		return nil, err
	}
	defer p.signalTaken()
	var first fetched
	select {
	case first = <-p.out:
	case <-ctx.Done():
		return nil, nil
	case <-time.After(r.cfg.FetchWait):
		return nil, nil
	}
	if first.err != nil {
		return nil, first.err
	}
	msgs := []*logMsg{first.m}
	for len(msgs) < r.cfg.Batch {
		select {
		case f := <-p.out:
			if f.err != nil {
				// The batch first; the next take returns it.
				p.err = f.err
				return msgs, nil
			}
			msgs = append(msgs, f.m)
			continue
		default:
		}
		break
	}
	return msgs, nil
}

// fetchHook runs the test hook at a point of the fetcher's: "fetch"
// before each pull (an error fails the pull), "wait" when it waits for
// what it fetched to be taken.
func (r *Runner) fetchHook(point string) error {
	if r.hook == nil {
		return nil
	}
	return r.hook(point)
}

// signalTaken tells the fetcher that take has emptied what it held.
func (p *prefetcher) signalTaken() {
	if len(p.out) > 0 {
		return
	}
	select {
	case p.taken <- struct{}{}:
	default:
	}
}
