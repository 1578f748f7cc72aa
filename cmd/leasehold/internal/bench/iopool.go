package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/worker"
)

// The io rows' baseline is the worker pool a good engineer writes on
// JetStream without leasehold, run as processes the way `leasehold worker`
// runs: each process takes its share of the partitions, reads each through
// a durable pull consumer of its own (explicit acks), a batch at a time,
// into a queue that a fixed pool of handlers (its in-flight count) takes
// jobs from, and acks a job once its handler has waited and its one
// effect's PubAck is in. The pool keeps no order: any handler may take any
// job, also two of one partition, which only helps it. The consumers are created before the processes start, as
// a deployment's would be. The processes are the leasehold binary in a
// hidden mode, `leasehold bench --io-pool-worker SPEC`.

// poolSpec is what one pool process is told on its command line.
type poolSpec struct {
	URL        string        `json:"url"`
	Prefix     string        `json:"prefix"`
	ID         string        `json:"id"`
	Partitions []int         `json:"partitions"`
	InFlight   int           `json:"in_flight"` // handlers of the process at once
	Work       time.Duration `json:"work"`      // each handler's wait
}

func poolConsumer(p int) string { return "pool-p" + strconv.Itoa(p) }

// poolReports is the subject prefix the pool's processes report on: .ready.<id> once they
// read their consumers, .acked.<id> with the jobs acked so far.
func poolReports(prefix string) string { return "_leasehold_bench." + prefix }

// ioPool is the pool's processes, seen from the bench.
type ioPool struct {
	e      *env
	prefix string
	nc     *nats.Conn
	js     jetstream.JetStream
	prod   *worker.Producer
	sub    *nats.Subscription
	procs  []*fleet.Proc
	k      chan struct{}

	mu    sync.Mutex
	ready map[string]bool
	acked map[string]int64
	want  int64
}

func (e *env) startIOPool(ctx context.Context, s ioSetup) (*ioPool, error) {
	prefix := fmt.Sprintf("iopl%d-%d", s.partitions, s.procs)
	nc, js, err := e.connect("bench pool " + prefix)
	if err != nil {
		return nil, err
	}
	pl := &ioPool{e: e, prefix: prefix, nc: nc, js: js, k: make(chan struct{}, 1), ready: map[string]bool{}, acked: map[string]int64{}}
	ok := false
	defer func() {
		if !ok {
			pl.close(ctx)
		}
	}()
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: s.partitions, Replicas: e.replicas()}); err != nil {
		return nil, err
	}
	if err := e.waitReplicas(ctx, js, worker.JobsStream(prefix), worker.EffectsStream(prefix)); err != nil {
		return nil, err
	}
	for p := range s.partitions {
		_, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
			return js.CreateOrUpdateConsumer(ctx, worker.JobsStream(prefix), jetstream.ConsumerConfig{
				Durable:       poolConsumer(p),
				FilterSubject: worker.JobSubject(prefix, leasehold.Partition(p)),
				AckPolicy:     jetstream.AckExplicitPolicy,
				// Fetched jobs wait in the process's queue, acked only
				// once handled: a run ends long before this.
				AckWait:       5 * time.Minute,
				MaxAckPending: 1000,
				Replicas:      e.replicas(),
			})
		})
		if err != nil {
			return nil, fmt.Errorf("create consumer %s: %w", poolConsumer(p), err)
		}
	}
	if pl.prod, err = worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: s.partitions}); err != nil {
		return nil, err
	}
	if pl.sub, err = nc.Subscribe(poolReports(prefix)+".>", pl.onReport); err != nil {
		return nil, err
	}
	_ = pl.sub.SetPendingLimits(-1, -1)
	ids := make([]string, s.procs)
	for i := range s.procs {
		ids[i] = fmt.Sprintf("%s-w%d", prefix, i)
		spec := poolSpec{URL: e.url, Prefix: prefix, ID: ids[i], InFlight: s.inFlightPerProc(), Work: ioWork}
		for p := i; p < s.partitions; p += s.procs {
			spec.Partitions = append(spec.Partitions, p)
		}
		proc, err := e.startIOPoolProc(ids[i], spec)
		if err != nil {
			return nil, err
		}
		pl.procs = append(pl.procs, proc)
	}
	err = wait(ctx, time.Minute, "every pool process reads its consumers", func() bool {
		pl.mu.Lock()
		defer pl.mu.Unlock()
		return len(pl.ready) == s.procs
	})
	if err != nil {
		return nil, err
	}
	ok = true
	return pl, nil
}

func (pl *ioPool) onReport(m *nats.Msg) {
	rest := strings.TrimPrefix(m.Subject, poolReports(pl.prefix)+".")
	kind, id, _ := strings.Cut(rest, ".")
	pl.mu.Lock()
	switch kind {
	case "ready":
		pl.ready[id] = true
	case "acked":
		if n, err := strconv.ParseInt(string(m.Data), 10, 64); err == nil {
			pl.acked[id] = max(pl.acked[id], n)
		}
	}
	pl.mu.Unlock()
	select {
	case pl.k <- struct{}{}:
	default:
	}
}

func (pl *ioPool) producer() *worker.Producer { return pl.prod }
func (pl *ioPool) kick() <-chan struct{}      { return pl.k }

func (pl *ioPool) pids() []int {
	out := make([]int, len(pl.procs))
	for i, p := range pl.procs {
		out[i] = p.Pid()
	}
	return out
}

func (pl *ioPool) expect(enq []worker.Enqueued) {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	pl.want += int64(len(enq))
}

func (pl *ioPool) done() bool {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	var n int64
	for _, a := range pl.acked {
		n += a
	}
	return n >= pl.want
}

func (pl *ioPool) close(ctx context.Context) {
	for _, p := range pl.procs {
		_ = p.Kill()
	}
	for _, p := range pl.procs {
		<-p.Exited()
	}
	if pl.sub != nil {
		_ = pl.sub.Unsubscribe()
	}
	pl.e.dropStreams(ctx, pl.js, pl.prefix+"-")
	pl.e.release(pl.nc)
}

// RunPoolWorker runs one process of the io rows' baseline pool until ctx
// ends: `leasehold bench --io-pool-worker SPEC`, which the bench starts
// itself.
func RunPoolWorker(ctx context.Context, specJSON string) error {
	var s poolSpec
	if err := json.Unmarshal([]byte(specJSON), &s); err != nil {
		return fmt.Errorf("pool worker spec: %w", err)
	}
	if s.URL == "" || s.Prefix == "" || s.ID == "" || len(s.Partitions) == 0 || s.InFlight < 1 || s.Work < 0 {
		return fmt.Errorf("pool worker spec %s: needs url, prefix, id, partitions and in_flight", specJSON)
	}
	nc, err := nats.Connect(s.URL, nats.Name("bench pool "+s.ID), nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	w := &poolWorker{s: s, nc: nc, js: js, queue: make(chan jetstream.Msg, s.InFlight), kick: make(chan struct{}, 1)}
	var conss []jetstream.Consumer
	for _, p := range s.Partitions {
		c, err := js.Consumer(ctx, worker.JobsStream(s.Prefix), poolConsumer(p))
		if err != nil {
			return fmt.Errorf("consumer %s: %w", poolConsumer(p), err)
		}
		conss = append(conss, c)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { w.report(ctx) })
	for range s.InFlight {
		wg.Go(func() { w.handler(ctx) })
	}
	for _, c := range conss {
		wg.Go(func() { w.partition(ctx, c) })
	}
	if err := nc.Publish(poolReports(s.Prefix)+".ready."+s.ID, nil); err != nil {
		return err
	}
	<-ctx.Done()
	wg.Wait()
	return nil
}

type poolWorker struct {
	s     poolSpec
	nc    *nats.Conn
	js    jetstream.JetStream
	queue chan jetstream.Msg // fetched jobs, for the handlers
	acked atomic.Int64
	kick  chan struct{}
}

// poolFetch is how many jobs one pull request of the pool asks for, as
// leasehold's worker asks for FetchBatch (default 100).
const poolFetch = 100

// partition reads one partition's jobs into the queue the process's
// handlers take them from, a batch at a time: the next jobs are in hand
// when a handler frees up, as they are in leasehold's worker.
func (w *poolWorker) partition(ctx context.Context, cons jetstream.Consumer) {
	for ctx.Err() == nil {
		// The wait is the server's: a fetch cut short by the client drops
		// what the server sent meanwhile until AckWait.
		batch, err := cons.Fetch(poolFetch, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			continue
		}
		for m := range batch.Messages() {
			select {
			case w.queue <- m:
			case <-ctx.Done():
				return
			}
		}
	}
}

// handler runs jobs from the queue, one at a time.
func (w *poolWorker) handler(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-w.queue:
			w.handle(ctx, m, worker.OutputSubject(w.s.Prefix, leasehold.Partition(partitionOf(m.Subject()))))
		}
	}
}

// partitionOf reads the partition from a job's subject, <prefix>.jobs.<p>.
func partitionOf(subject string) int {
	p, _ := strconv.Atoi(subject[strings.LastIndexByte(subject, '.')+1:])
	return p
}

// handle waits, publishes the job's effect and waits for its PubAck, then
// acks the job.
func (w *poolWorker) handle(ctx context.Context, m jetstream.Msg, out string) {
	t := time.NewTimer(w.s.Work)
	select {
	case <-t.C:
	case <-ctx.Done():
		t.Stop()
		return
	}
	md, err := m.Metadata()
	if err != nil {
		_ = m.Term()
		return
	}
	eff := &nats.Msg{Subject: out, Data: m.Data(), Header: nats.Header{}}
	eff.Header.Set(jetstream.MsgIDHeader, out+"."+strconv.FormatUint(md.Sequence.Stream, 10))
	if _, err := w.js.PublishMsg(ctx, eff); err != nil {
		if !errors.Is(err, context.Canceled) {
			_ = m.Nak()
		}
		return
	}
	if m.Ack() == nil {
		w.acked.Add(1)
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
}

// report publishes the count of jobs acked whenever it has grown.
func (w *poolWorker) report(ctx context.Context) {
	subject := poolReports(w.s.Prefix) + ".acked." + w.s.ID
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.kick:
		}
		_ = w.nc.Publish(subject, strconv.AppendInt(nil, w.acked.Load(), 10))
	}
}
