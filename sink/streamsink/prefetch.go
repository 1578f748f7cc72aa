package streamsink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/telemetry"
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
	// batch is the slice take returns, reused: Run's goroutine handles
	// one batch at a time, and nothing keeps it past handle.
	batch []*logMsg
	// taken is signalled when take empties out: the next pull may start.
	taken chan struct{}
	// nak, set before stop: hand what it holds back to the server.
	nak atomic.Bool

	// Owned by the fetching goroutine.
	msgs    chan *nats.Msg // the subscription's
	sub     *nats.Subscription
	inbox   string // the subscription is to inbox.*; pull n answers to inbox.n
	pulls   uint64
	dropped int    // by the subscription, as last counted
	subject string // the consumer's pull request subject
	request []byte
	// slab holds the logMsgs the pull hands on next: made a few at a
	// time, one allocation where each message took one. Only the batch
	// they are handled in points at them (heldCopy copies what a group
	// keeps).
	slab []logMsg
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
// consumer allows unacked, for heartbeats and the statuses that end pulls,
// and for messages that are not the server's.
const pullSlack = 256

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
	// and every one in msgs is: the server's own messages never fill it.
	// Messages of anyone else on the inbox can (see countDropped).
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
// When it ends, its subscription goes (see unsubscribe): the server sends
// a pull with no subscriber nothing more, and with nak what came and
// nobody took goes back to the server.
func (r *Runner) prefetch(ctx context.Context, p *prefetcher) {
	defer p.unsubscribe()
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

// unsubscribe ends the subscription. With nak it drains it: the server
// learns that the subscription is gone, and what it sent before that
// (a pull's deliveries on their way) still comes in and is handed back;
// ended at once, those would wait for AckWait. Without nak (a crash in a
// test) it ends it at once, and hands nothing back.
func (p *prefetcher) unsubscribe() {
	nak := p.nak.Load()
	handBack := func(m *nats.Msg) {
		if nak && m.Reply != "" {
			_ = m.Nak()
		}
	}
	if p.sub != nil {
		if !nak {
			_ = p.sub.Unsubscribe()
		} else {
			closed := p.sub.StatusChanged(nats.SubscriptionClosed)
			if err := p.sub.Drain(); err != nil {
				_ = p.sub.Unsubscribe()
			}
			bound := time.NewTimer(stopGrace)
		drain:
			for {
				select {
				case m := <-p.msgs:
					handBack(m)
				case <-closed:
					break drain
				case <-bound.C:
					_ = p.sub.Unsubscribe()
					break drain
				}
			}
			bound.Stop()
		}
	}
	for {
		select {
		case m := <-p.msgs:
			handBack(m)
		default:
			return
		}
	}
}

// stopGrace bounds how long a stopping runner drains its subscription.
const stopGrace = 5 * time.Second

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
		p.inbox = nc.NewInbox()
		sub, err := nc.ChanSubscribe(p.inbox+".*", p.msgs)
		if err != nil {
			return fmt.Errorf("fetch from %s: subscribe: %w", r.cfg.Stream, err)
		}
		p.sub = sub
	}
	defer r.countDropped(p)
	// What is left of the slab goes with the pull: kept, it would keep
	// the messages handed on from it, long handled, for the next pulls.
	defer func() { p.slab = nil }()
	// Each pull answers to a subject of its own: the status that ends
	// it is the one sent there, not a late end of an earlier pull, nor
	// anything else published on the inbox. Deliveries of earlier pulls
	// are deliveries all the same.
	p.pulls++
	reply := p.inbox + "." + strconv.FormatUint(p.pulls, 10)
	if err := nc.PublishRequest(p.subject, reply, p.request); err != nil {
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
			if m.Subject != reply {
				continue // an earlier pull's, or not the server's
			}
			switch status := m.Header.Get("Status"); status {
			case "100": // idle heartbeat
				timer.Reset(p.quiet)
				continue
			case "404", "408": // the pull expired
				return nil
			case "":
				continue // not the server's: nothing to do with it
			case "503":
				return fmt.Errorf("fetch from %s: no responders to the pull request: the consumer %s does not exist (deleted?) or the stream is unavailable; a sink with Provision creates it when it starts", r.cfg.Stream, r.cfg.Consumer)
			default:
				return fmt.Errorf("fetch from %s: pull request ended: status %s %s", r.cfg.Stream, status, m.Header.Get("Description"))
			}
		}
		meta, err := m.Metadata()
		if err != nil {
			continue
		}
		n++
		if len(p.slab) == 0 {
			p.slab = make([]logMsg, min(r.cfg.Batch-n+1, logMsgSlab))
		}
		lm := &p.slab[0]
		p.slab = p.slab[1:]
		*lm = logMsg{seq: meta.Sequence.Stream, subject: m.Subject, header: m.Header, data: m.Data, msg: m}
		select {
		case p.out <- fetched{m: lm}:
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

// logMsgSlab is how many logMsgs the fetcher makes at once, at most: a
// slab lives as long as the last batch that holds one of its messages.
const logMsgSlab = 32

// countDropped notes the messages the subscription dropped since it last
// looked: it was full, which takes a flood of messages on its inbox (the
// server's own never fill it). Deliveries among them come again only after
// AckWait, and until then the consumer may hold back the rest: counted in
// leasehold_sink_fetch_dropped_total, logged, and shown by Ready for
// AckWait.
func (r *Runner) countDropped(p *prefetcher) {
	n, err := p.sub.Dropped()
	if err != nil || n <= p.dropped {
		return
	}
	d := n - p.dropped
	p.dropped = n
	r.dropped.Add(int64(d))
	r.droppedAt.Store(time.Now().UnixNano())
	r.log.Warn("streamsink: the fetcher's subscription was full and dropped messages: deliveries among them come again after AckWait; a flood of messages on its inbox fills it",
		"sink", r.cfg.Name, "dropped", d, "inbox", p.inbox, "ack_wait", r.cfg.AckWait)
}

// fetchDropped is Ready's word on dropped deliveries: an error for
// AckWait after the last drop.
func (r *Runner) fetchDropped() error {
	at := r.droppedAt.Load()
	if at == 0 {
		return nil
	}
	if d := time.Since(time.Unix(0, at)); d < r.cfg.AckWait {
		return fmt.Errorf("streamsink: sink %s: its fetcher's subscription dropped %d messages in all, the last %v ago: deliveries among them come again after AckWait (%v), and the consumer may hold the rest back until then; a flood of messages on its inbox fills it", r.cfg.Name, r.dropped.Load(), d.Round(time.Second), r.cfg.AckWait)
	}
	return nil
}

// registerFetchMetrics reports the messages the fetcher's subscription
// dropped, leasehold_sink_fetch_dropped_total{leasehold_sink}.
func (r *Runner) registerFetchMetrics() error {
	mp := r.cfg.Telemetry.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	attrs := metric.WithAttributes(telemetry.AttrSink.String(r.cfg.Name))
	_, err := mp.Meter("github.com/leasehold/leasehold/sink/streamsink").Int64ObservableCounter("leasehold.sink.fetch_dropped",
		metric.WithDescription("Messages a stream sink's fetcher dropped because its subscription was full (a flood on its inbox): deliveries among them come again after AckWait, and Ready fails until then."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(r.dropped.Load(), attrs)
			return nil
		}))
	if err != nil {
		return fmt.Errorf("streamsink: register the fetch dropped counter: %w", err)
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
	// The last batch is handled: its messages go, and the slice is
	// used again.
	clear(p.batch)
	msgs := append(p.batch[:0], first.m)
	for len(msgs) < r.cfg.Batch {
		select {
		case f := <-p.out:
			if f.err != nil {
				// The batch first; the next take returns it.
				p.err = f.err
				p.batch = msgs
				return msgs, nil
			}
			msgs = append(msgs, f.m)
			continue
		default:
		}
		break
	}
	p.batch = msgs
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
