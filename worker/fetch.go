package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
)

// fetcher reads one partition's jobs, in order, into out. It pulls from
// an ephemeral consumer that starts at a given sequence and acks nothing
// (progress is the lease's, not the consumer's): one pull request at a
// time on one subscription that lives as long as the consumer, the next
// request sent as soon as the previous one's jobs are handed over, so a
// batch is always in hand. It does not use Consume: in nats.go v1.55 a
// refill that falls due while a pull request is being sent is skipped, and
// a consumer with a backlog stalls until the heartbeat check fires. Nor
// does it use Fetch, which subscribes, allocates its buffers and starts a
// goroutine for every request: a worker holds hundreds of partitions, most
// of them idle, each with a request always waiting. When anything looks
// wrong (an error status, a missed heartbeat, a gap in the delivery
// sequence) it drops the consumer and creates a new one at the next
// sequence it needs, which also covers a server restart that forgot the
// consumer.
type fetcher struct {
	r      *runner
	out    chan *jobMsg
	cancel context.CancelFunc
	done   chan struct{}
	gaps   gapState // owned by run's goroutine (gap.go)
}

// errGap reports a message the consumer skipped.
var errGap = errors.New("delivery sequence gap")

func (r *runner) startFetch(from uint64) *fetcher {
	ctx, cancel := context.WithCancel(r.ctx)
	f := &fetcher{r: r, out: make(chan *jobMsg, r.w.cfg.FetchBatch), cancel: cancel, done: make(chan struct{}), gaps: r.newGapState()}
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
	// name is the consumer being created: it stays the same until a try
	// succeeds, so a try whose answer was lost (sent just before the
	// connection dropped, or to a server still starting) is not left
	// behind as a second consumer: creating it again with the same
	// config answers with the one the lost try made.
	name, tries := "", 0
	for failures := 0; ctx.Err() == nil; {
		if failures > 0 {
			if sleep(ctx, min(50*time.Millisecond<<min(failures-1, 6), 2*time.Second)) != nil {
				return
			}
		}
		if name == "" {
			name = "lh-" + nuid.Next()
		}
		// Each try is bounded on its own, whatever the JetStream
		// context's default timeout: a request lost with a dropped
		// connection is never answered, and the partition would wait
		// that long with its jobs pending.
		tctx, cancel := context.WithTimeout(ctx, apiTry(tries))
		cons, err := cfg.JetStream.CreateConsumer(tctx, JobsStream(cfg.Prefix), jetstream.ConsumerConfig{
			Name:              name,
			Description:       fmt.Sprintf("leasehold worker %s, partition %d, epoch %d", f.r.info.Holder, f.r.p, f.r.info.Epoch),
			DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:       next,
			AckPolicy:         jetstream.AckNonePolicy,
			FilterSubject:     f.r.subject,
			MemoryStorage:     true,
			Replicas:          1,
			InactiveThreshold: time.Minute,
		})
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				failures++
				tries++
				log := f.r.log.Debug
				if failures%20 == 5 {
					log = f.r.log.Warn // not a blip: say so, now and then
				}
				log("create job consumer failed; retrying", "from", next, "attempt", failures, "err", err)
			}
			continue
		}
		// Keep the name and the batch only: the consumer's cached info, a
		// few KiB a held partition, need not live while its jobs are read,
		// so nothing reads it once pull starts. A server whose JetStream
		// limits cap a request's batch gives the consumer that cap, and
		// refuses every request for more.
		info := cons.CachedInfo()
		made, batch := info.Name, cfg.FetchBatch
		if limit := info.Config.MaxRequestBatch; limit > 0 && limit < batch {
			batch = limit
		}
		name, tries = "", 0 // the next consumer is a new one
		start := next
		next, err = f.pull(ctx, made, batch, next)
		f.r.deleteConsumer(made)
		if ctx.Err() != nil {
			return
		}
		if next > start {
			failures = 0
		}
		failures++
		log := f.r.log.Debug // one end is a blip: a restart, a leader change
		if failures%20 == 5 {
			log = f.r.log.Warn // ending again and again with no job read: say why
		}
		log("job consumer ended; starting a new one", "from", next, "attempt", failures, "err", err)
	}
}

// pullRequest is the body of a JetStream pull request
// ($JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>).
type pullRequest struct {
	Batch     int           `json:"batch"`
	Expires   time.Duration `json:"expires"`
	Heartbeat time.Duration `json:"idle_heartbeat,omitempty"`
}

// errMissedHeartbeat reports a pull request the server stopped answering.
var errMissedHeartbeat = errors.New("no heartbeat from the pull request")

// pullSlack is the room the subscription has beyond one batch, for the
// heartbeats and the status that end a request, which arrive while the
// batch waits to be handed over.
const pullSlack = 16

// pull sends pull requests for batch jobs to the consumer named name
// until something goes wrong, handing each job to out; it returns the next
// sequence to read.
func (f *fetcher) pull(ctx context.Context, name string, batch int, next uint64) (uint64, error) {
	cfg := &f.r.w.cfg
	nc := cfg.JetStream.Conn()
	// One request is outstanding at a time and asks for at most a batch:
	// the subscription holds what it sends without ever dropping (a drop
	// would show as a gap).
	msgs := make(chan *nats.Msg, batch+pullSlack)
	sub, err := nc.ChanSubscribe(nc.NewInbox(), msgs)
	if err != nil {
		return next, fmt.Errorf("subscribe for jobs: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	req := pullRequest{Batch: batch, Expires: cfg.FetchWait}
	// Without word from the server for this long the request is gone: two
	// heartbeats, or with none (a short FetchWait) its expiry and a second.
	quiet := cfg.FetchWait + time.Second
	if cfg.FetchWait >= time.Second {
		req.Heartbeat = cfg.FetchWait / 5
		quiet = 2 * req.Heartbeat
	}
	body, err := json.Marshal(req)
	if err != nil {
		return next, err
	}
	subject := jspub.APIPrefix(cfg.JetStream) + "CONSUMER.MSG.NEXT." + JobsStream(cfg.Prefix) + "." + name
	timer := time.NewTimer(quiet)
	defer timer.Stop()
	var delivered uint64
	for {
		if err := nc.PublishRequest(subject, sub.Subject, body); err != nil {
			return next, fmt.Errorf("pull request: %w", err)
		}
		timer.Reset(quiet)
		n, pending := 0, uint64(0)
		expired := false // the server said the request ended
	request:
		for n < batch {
			var m *nats.Msg
			select {
			case m = <-msgs:
			case <-timer.C:
				if req.Heartbeat > 0 {
					return next, fmt.Errorf("%w for %v", errMissedHeartbeat, quiet)
				}
				break request // its end was lost: send the next
			case <-ctx.Done():
				return next, ctx.Err()
			}
			// A status comes without a reply subject; a job always has one
			// (its metadata is in it), whatever its headers say.
			if status := m.Header.Get("Status"); status != "" && len(m.Data) == 0 && m.Reply == "" {
				switch status {
				case "100": // idle heartbeat
					timer.Reset(quiet)
					continue
				case "404", "408": // the request expired
					expired = true
					break request
				}
				return next, fmt.Errorf("pull request ended: status %s %s", status, m.Header.Get("Description"))
			}
			md, err := m.Metadata()
			if err != nil {
				return next, fmt.Errorf("job metadata: %w", err)
			}
			if md.Sequence.Consumer != delivered+1 {
				return next, fmt.Errorf("%w: expected delivery %d, got %d", errGap, delivered+1, md.Sequence.Consumer)
			}
			delivered++
			n++
			pending = md.NumPending
			if md.Sequence.Stream >= next {
				// Jobs between that were removed unrun are recorded
				// before progress can pass them.
				if err := f.checkGap(ctx, next, md); err != nil {
					return next, err
				}
				f.gaps.last = md.Timestamp
				next = md.Sequence.Stream + 1
				select {
				case f.out <- newJobMsg(m, md):
				case <-ctx.Done():
					return next, ctx.Err()
				}
			} // else: already handed over
			// However long the hand-over took, the heartbeats that came
			// meanwhile wait in msgs.
			timer.Reset(quiet)
		}
		if n == 0 && expired && f.r.committedSeq.Load()+1 >= next {
			// Nothing waits: the partition is caught up. A request whose
			// end was lost says nothing of the kind (the connection may have
			// gone silent), so that a stall shows for as long as it lasts.
			f.r.touch()
		}
		if n > 0 && n < batch && pending > 0 {
			// The request ended while jobs were waiting: it expired instead
			// of being filled. Count it, so that a stall cannot hide.
			f.r.w.stalls.Add(1)
			f.r.log.Warn("a pull request expired while jobs were waiting", "pending", pending, "received", n)
		}
	}
}

// jobMsg is a job as the fetcher's pull requests receive it. The consumer
// acknowledges nothing, so neither does it.
type jobMsg struct {
	m  *nats.Msg
	md jetstream.MsgMetadata
}

// errAckNone refuses an acknowledgement of a job.
var errAckNone = errors.New("worker: job consumers acknowledge nothing: progress is committed through the lease")

func newJobMsg(m *nats.Msg, md *nats.MsgMetadata) *jobMsg {
	return &jobMsg{m: m, md: jetstream.MsgMetadata{
		Sequence:     jetstream.SequencePair{Consumer: md.Sequence.Consumer, Stream: md.Sequence.Stream},
		NumDelivered: md.NumDelivered,
		NumPending:   md.NumPending,
		Timestamp:    md.Timestamp,
		Stream:       md.Stream,
		Consumer:     md.Consumer,
		Domain:       md.Domain,
	}}
}

func (j *jobMsg) Metadata() (*jetstream.MsgMetadata, error) { md := j.md; return &md, nil }
func (j *jobMsg) Data() []byte                              { return j.m.Data }
func (j *jobMsg) Headers() nats.Header                      { return j.m.Header }
func (j *jobMsg) Subject() string                           { return j.m.Subject }
func (j *jobMsg) Reply() string                             { return j.m.Reply }
func (j *jobMsg) Ack() error                                { return errAckNone }
func (j *jobMsg) DoubleAck(context.Context) error           { return errAckNone }
func (j *jobMsg) Nak() error                                { return errAckNone }
func (j *jobMsg) NakWithDelay(time.Duration) error          { return errAckNone }
func (j *jobMsg) InProgress() error                         { return errAckNone }
func (j *jobMsg) Term() error                               { return errAckNone }
func (j *jobMsg) TermWithReason(string) error               { return errAckNone }

// deleteConsumer removes an ephemeral consumer this runner is done with.
// The server would remove it after its inactivity threshold anyway.
func (r *runner) deleteConsumer(name string) {
	js := r.w.cfg.JetStream
	if !js.Conn().IsConnected() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = js.DeleteConsumer(ctx, JobsStream(r.w.cfg.Prefix), name)
}
