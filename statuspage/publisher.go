package statuspage

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	JetStream jetstream.JetStream
	Prefix    string // the job streams' prefix: events go to <prefix>-events
	Source    string // this process: a worker's ID or a sink's name
	// Queue bounds the events waiting to be published. Default 1024. An
	// event that finds the queue full is dropped and counted.
	Queue int
	// Timeout bounds one publish. Default 2s.
	Timeout       time.Duration
	MeterProvider metric.MeterProvider // default: the global one
	Logger        *slog.Logger
}

// Publisher publishes events from the observer hooks of a worker or sink.
// Its hooks never block: each event goes into a bounded queue that one
// goroutine drains; when the queue is full, or the stream is missing or
// unreachable, the event is dropped and counted in
// leasehold_status_events_dropped_total. The fenced path never waits for
// the status page.
type Publisher struct {
	cfg     PublisherConfig
	queue   chan *Event // pointers: a full queue of values would hold Queue events' room from the start
	dropped metric.Int64Counter
	drops   atomic.Int64
	stop    chan struct{}
	done    chan struct{}
	once    sync.Once

	lastWarn time.Time // owned by the publishing goroutine

	epMu sync.Mutex
	eps  map[[2]string]endpointSeen // by relay and endpoint
}

// endpointSeen is the last event published of an endpoint.
type endpointSeen struct {
	down bool
	at   time.Time
}

// EndpointReminder is how often an endpoint that stays down is published
// again, so that the page, which reads the last hour of events, keeps
// showing it.
const EndpointReminder = 10 * time.Minute

// NewPublisher starts a Publisher; Close stops it.
func NewPublisher(cfg PublisherConfig) *Publisher {
	if cfg.Queue <= 0 {
		cfg.Queue = 1024
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.MeterProvider == nil {
		cfg.MeterProvider = otel.GetMeterProvider()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Publisher{cfg: cfg, queue: make(chan *Event, cfg.Queue), stop: make(chan struct{}), done: make(chan struct{})}
	p.dropped, _ = cfg.MeterProvider.Meter(telemetry.ScopeName).Int64Counter("leasehold.status.events.dropped",
		metric.WithDescription("Status-page events dropped unpublished: the queue was full, or the events stream did not take them."),
		metric.WithUnit("{event}"))
	go p.run()
	return p
}

// Dropped is how many events were dropped so far.
func (p *Publisher) Dropped() int64 { return p.drops.Load() }

// Close publishes what is queued, for up to the publish timeout, and stops.
func (p *Publisher) Close() {
	p.once.Do(func() { close(p.stop) })
	<-p.done
}

// Publish queues e, or drops it when the queue is full. It never blocks.
func (p *Publisher) Publish(e Event) {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	e.Source = p.cfg.Source
	for _, s := range []*string{&e.Source, &e.Scope, &e.Lock, &e.Worker, &e.Holder, &e.Outcome, &e.Key, &e.Reason,
		&e.Actor, &e.Action, &e.Target, &e.Result, &e.Relay, &e.Endpoint, &e.Origin} {
		*s = truncate(*s)
	}
	select {
	case p.queue <- &e:
	default:
		p.drop(errQueueFull)
	}
}

// errQueueFull is the reason of a drop on a full queue, which Publish
// counts without logging (it runs on the caller's goroutine).
const errQueueFull = "the queue is full"

func (p *Publisher) drop(why string) {
	p.drops.Add(1)
	p.dropped.Add(context.Background(), 1)
	if why == errQueueFull {
		return
	}
	// Only the publishing goroutine gets here, so lastWarn has one owner.
	if time.Since(p.lastWarn) > time.Minute {
		p.lastWarn = time.Now()
		p.cfg.Logger.Warn("status-page events are not published", "stream", EventsStream(p.cfg.Prefix), "why", why,
			"hint", "`leasehold init`, worker.ProvisionJobs or statuspage.ProvisionEvents creates the stream; the status page misses these events")
	}
}

func (p *Publisher) run() {
	defer close(p.done)
	for {
		select {
		case e := <-p.queue:
			p.send(e)
		case <-p.stop:
			deadline := time.Now().Add(p.cfg.Timeout)
			for time.Now().Before(deadline) {
				select {
				case e := <-p.queue:
					p.send(e)
				default:
					return
				}
			}
			return
		}
	}
}

func (p *Publisher) send(e *Event) {
	data, err := json.Marshal(e)
	if err != nil || len(data) > MaxEventSize {
		p.drop("an event too large to publish")
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout)
	defer cancel()
	if _, err := p.cfg.JetStream.Publish(ctx, EventSubject(p.cfg.Prefix, e.Kind), data, jetstream.WithExpectStream(EventsStream(p.cfg.Prefix))); err != nil {
		p.drop(err.Error())
	}
}

// WorkerObserver returns an observer that publishes a worker's
// acquisitions, releases and losses, then hands every event to next (when
// not nil).
func (p *Publisher) WorkerObserver(next worker.Observer) worker.Observer {
	return worker.ObserverFunc(func(ctx context.Context, e worker.Event) {
		if next != nil {
			next.WorkerEvent(ctx, e)
		}
		ev := Event{Time: e.Time, Scope: e.Lease.Scope, Partition: uint32(e.Lease.Partition), Worker: e.Lease.Holder, Epoch: uint64(e.Lease.Epoch)}
		switch e.Kind {
		case worker.EventPartitionAcquired:
			ev.Kind = KindAcquired
		case worker.EventPartitionDrained:
			ev.Kind = KindReleased
		case worker.EventPartitionLost:
			ev.Kind = KindLost
			ev.Reason = LossReason("", "", e.Err)
		default:
			return
		}
		p.Publish(ev)
	})
}

// EndpointObserver returns what an HTTP relay's Config.OnEndpoint takes:
// it publishes an endpoint going down (its first failure, with the error)
// and answering again, and, while it stays down, an event every
// EndpointReminder with the last error. The page's Destinations panel
// shows them.
func (p *Publisher) EndpointObserver() func(httpsink.EndpointHealth) {
	return func(h httpsink.EndpointHealth) {
		k := [2]string{h.Relay, h.Endpoint}
		now := time.Now()
		p.epMu.Lock()
		if p.eps == nil {
			p.eps = map[[2]string]endpointSeen{}
		}
		last, seen := p.eps[k]
		publish := !seen && h.Down || seen && last.down != h.Down || h.Down && now.Sub(last.at) >= EndpointReminder
		if publish {
			p.eps[k] = endpointSeen{down: h.Down, at: now}
		}
		p.epMu.Unlock()
		if !publish {
			return
		}
		p.Publish(Event{Kind: KindEndpoint, Time: now, Relay: h.Relay, Endpoint: h.Endpoint, Origin: h.Origin, Down: h.Down, Since: h.Since, Reason: oneLine(h.Err)})
	}
}

// LockObserver returns a coordinator observer that publishes the
// acquisitions, releases and losses of named locks (partitions are the
// WorkerObserver's), then hands every event to next (when not nil). Give
// it to the Observer of the coordinator.Config that takes the locks.
func (p *Publisher) LockObserver(next coordinator.Observer) coordinator.Observer {
	return lockObserver{p, next}
}

type lockObserver struct {
	p    *Publisher
	next coordinator.Observer
}

func (o lockObserver) LeaseEvent(ctx context.Context, e coordinator.Event) {
	if o.next != nil {
		o.next.LeaseEvent(ctx, e)
	}
	if e.Lock == "" || e.Member {
		return
	}
	ev := Event{Time: e.Time, Scope: e.Lease.Scope, Lock: e.Lock, Worker: e.Lease.Holder, Epoch: uint64(e.Lease.Epoch)}
	switch e.Kind {
	case coordinator.EventAcquired:
		ev.Kind = KindAcquired
	case coordinator.EventReleased:
		ev.Kind = KindReleased
	case coordinator.EventLost:
		ev.Kind, ev.Reason = KindLost, LossReason(e.Reason, e.Holder, e.Err)
	default:
		return
	}
	o.p.Publish(ev)
}

// SinkObserver returns an observer that publishes every write a sink
// refused for good (stale, split-brain, unverified, bad stamp, over a
// limit).
func (p *Publisher) SinkObserver() sink.Observer {
	return sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		if !d.Outcome.Dropped() {
			return
		}
		scope := d.Stamp.Scope
		if scope == "" {
			scope = "?" // a stamp that could not be read
		}
		p.Publish(Event{
			Kind: KindRefused, Scope: scope, Partition: uint32(d.Stamp.Partition),
			Worker: d.Stamp.Worker, Epoch: uint64(d.Stamp.Epoch), Max: uint64(d.Max), Holder: d.Holder,
			Outcome: d.Outcome.String(), Key: d.Stamp.Key,
		})
	})
}

// LossReason says in one line why a lease was lost, for the page: the
// reason (deadline, refused, session), who holds it now when known, and
// what ended a session. The whole error, with every cause it wraps, is in
// the worker's log. reason and holder may be empty when err (a
// *coordinator.LostError) carries them.
func LossReason(reason coordinator.LostReason, holder string, err error) string {
	var lost *coordinator.LostError
	if errors.As(err, &lost) {
		reason, holder, err = cmp.Or(reason, lost.Reason), cmp.Or(holder, lost.Holder), lost.Err
	}
	var s string
	switch reason {
	case coordinator.LostDeadline:
		s = "deadline: no renewal succeeded before the lease's local deadline"
	case coordinator.LostRefused:
		s = "refused: another write replaced the lease (a take-over, or `leasehold fence`)"
	case coordinator.LostSession:
		s = "session: the worker's member registration ended"
		var member *coordinator.LostError
		if errors.As(err, &member) && member.Reason == coordinator.LostDeadline {
			s += " (no renewal in time)"
		}
	case "":
		if err == nil {
			return ""
		}
		return oneLine(err.Error())
	default:
		s = string(reason)
	}
	if holder != "" {
		s += "; now held by " + holder
	}
	return s
}

// oneLine is an error message as one short line: its first line, at most
// 160 characters.
func oneLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if r := []rune(s); len(r) > 160 {
		s = string(r[:159]) + "…"
	}
	return s
}

// fenceOf names an event's fence, for folding.
func fenceOf(e Event) leasehold.FenceID {
	return leasehold.FenceID{Scope: e.Scope, Partition: leasehold.Partition(e.Partition)}
}
