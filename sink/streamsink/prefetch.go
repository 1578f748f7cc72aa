package streamsink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold/internal/jspub"
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
// Its pull requests share one subscription, which lives as long as the
// prefetcher, and each ends when the server says so (its expiry, or a
// full batch). Not Consume, which can stall a consumer with a backlog until
// its heartbeat check fires; nor Fetch, which ends its subscription at a
// deadline of the client's own: a message the server sent just before a
// pull's expiry (a large one, or any on a busy machine) reached no
// subscriber, and the runner sat idle for AckWait until it came again.
type prefetcher struct {
	out  chan fetched
	stop context.CancelFunc
	done chan struct{}
	err  error // a fetch error met while a batch was taken, for the next take
	// taken is signalled when take empties out: the next pull may start.
	taken chan struct{}
	// nak, set before stop: hand what it holds back to the server.
	nak atomic.Bool

	// Owned by the fetching goroutine.
	msgs    chan *nats.Msg // the subscription's
	sub     *nats.Subscription
	subject string // the consumer's pull request subject
	request []byte
	// quiet is how long a pull may go without word from the server:
	// two heartbeats, or with none (a short FetchWait) its expiry and a
	// second.
	quiet     time.Duration
	heartbeat bool
}

// fetched is one message, or the error of a failed fetch.
type fetched struct {
	m   *logMsg
	err error
}

// pullSlack is the room the subscription has beyond the deliveries the
// consumer allows unacked, for heartbeats and the statuses that end pulls.
const pullSlack = 16

// startPrefetch starts fetching; stop it with halt.
func (r *Runner) startPrefetch(ctx context.Context) *prefetcher {
	ctx, cancel := context.WithCancel(ctx)
	// A pull's messages and an error fit: the fetcher never blocks on a
	// send while its pull is open.
	p := &prefetcher{out: make(chan fetched, r.cfg.Batch+1), stop: cancel, done: make(chan struct{}), taken: make(chan struct{}, 1)}
	req := struct {
		Batch     int           `json:"batch"`
		Expires   time.Duration `json:"expires"`
		Heartbeat time.Duration `json:"idle_heartbeat,omitempty"`
	}{Batch: r.cfg.Batch, Expires: r.cfg.FetchWait}
	p.quiet = r.cfg.FetchWait + time.Second
	if r.cfg.FetchWait >= time.Second {
		req.Heartbeat = min(r.cfg.FetchWait/5, 5*time.Second)
		p.quiet, p.heartbeat = 2*req.Heartbeat, true
	}
	p.request, _ = json.Marshal(req)
	p.subject = jspub.APIPrefix(r.js) + "CONSUMER.MSG.NEXT." + r.cfg.Stream + "." + r.cfg.Consumer
	// The consumer sends no more than MaxAckPending deliveries unacked,
	// and every one in msgs is: the subscription never drops one.
	p.msgs = make(chan *nats.Msg, 4*r.cfg.Batch+pullSlack)
	go func() {
		defer close(p.done)
		r.prefetch(ctx, p)
	}()
	return p
}

// prefetch fetches until ctx ends. A failed fetch is handed on, for Run to
// count, log and show in Ready, and tried again after a backoff.
//
// When it ends, its subscription goes (the server sends a pull with no
// subscriber nothing more), and with nak what came and nobody took goes
// back to the server. A message already on its way then waits for
// AckWait, as a crashed runner's do.
func (r *Runner) prefetch(ctx context.Context, p *prefetcher) {
	defer func() {
		if p.sub != nil {
			_ = p.sub.Unsubscribe()
		}
		for {
			select {
			case m := <-p.msgs:
				if p.nak.Load() && m.Reply != "" {
					_ = m.Nak()
				}
			default:
				return
			}
		}
	}()
	timer := time.NewTimer(p.quiet)
	defer timer.Stop()
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
		err := r.fetchInto(ctx, p, timer)
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
// up to Config.FetchWait, and hands each message on as it arrives. It
// returns when the server ends the pull, or when the pull has gone quiet
// for longer than it may.
func (r *Runner) fetchInto(ctx context.Context, p *prefetcher, timer *time.Timer) error {
	r.lastPull.Store(time.Now().UnixNano())
	if err := r.fetchHook("fetch"); err != nil {
		return fmt.Errorf("fetch from %s: %w", r.cfg.Stream, err)
	}
	nc := r.js.Conn()
	if p.sub == nil {
		sub, err := nc.ChanSubscribe(nc.NewInbox(), p.msgs)
		if err != nil {
			return fmt.Errorf("fetch from %s: subscribe: %w", r.cfg.Stream, err)
		}
		p.sub = sub
	}
	if err := nc.PublishRequest(p.subject, p.sub.Subject, p.request); err != nil {
		return fmt.Errorf("fetch from %s: pull request: %w", r.cfg.Stream, err)
	}
	timer.Reset(p.quiet)
	for n := 0; n < r.cfg.Batch; {
		var m *nats.Msg
		select {
		case m = <-p.msgs:
		case <-timer.C:
			if p.heartbeat {
				return fmt.Errorf("fetch from %s: %w for %v", r.cfg.Stream, errMissedHeartbeat, p.quiet)
			}
			return nil // its end was lost: send the next
		case <-ctx.Done():
			return nil
		}
		// A status comes without a reply subject; a delivery always has
		// one (its metadata is in it), whatever its headers say.
		if m.Reply == "" {
			switch status := m.Header.Get("Status"); status {
			case "100": // idle heartbeat
				timer.Reset(p.quiet)
				continue
			case "404", "408": // the pull expired
				return nil
			case "":
				continue // not the server's: nothing to do with it
			default:
				return fmt.Errorf("fetch from %s: pull request ended: status %s %s", r.cfg.Stream, status, m.Header.Get("Description"))
			}
		}
		meta, err := m.Metadata()
		if err != nil {
			continue
		}
		n++
		select {
		case p.out <- fetched{m: &logMsg{seq: meta.Sequence.Stream, subject: m.Subject, header: m.Header, data: m.Data, msg: m}}:
		case <-ctx.Done():
			if p.nak.Load() {
				_ = m.Nak()
			}
			return nil
		}
		// However long the hand-over took, the heartbeats that came
		// meanwhile wait in msgs.
		timer.Reset(p.quiet)
	}
	return nil
}

// errMissedHeartbeat reports a pull request the server stopped answering.
var errMissedHeartbeat = errors.New("no heartbeat from the pull request")

// halt stops the prefetcher and waits for it. With nak, the messages it
// holds are handed back to the server for redelivery at once (a runner
// that stops); without, they wait for AckWait, as a crashed runner's do.
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
