package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// The two pipelines do the same work over the same hops: a producer
// enqueues jobs on a 16-partition stream; four workers, each on its own
// connection, pull them, run a handler that publishes one effect, and let
// go of a job only once its effect's PubAck is in; one consumer applies the
// effects to memory. leasehold adds the lease, the stamp, fenced progress
// and the stream sink runner's fence and saved position; the raw pipeline
// acks each job after its effect's PubAck and each effect after applying
// it.
const (
	pipePartitions = 16
	pipeWorkers    = 4
	pipePayload    = 256
	pipeBatch      = 100
	// rawSinkBatch is what the raw pipeline's consumer fetches at once:
	// what leasehold's stream sink runner fetches by default
	// (streamsink.Config.Batch), which serves a hand-written consumer
	// as well.
	rawSinkBatch = 400
)

// applied counts the effects a pipeline's consumer applied, and records
// their latency from the send time the payload carries.
type applied struct {
	want  int64
	n     atomic.Int64
	done  chan struct{}
	timed bool

	mu  sync.Mutex
	lat []float64 // milliseconds
}

func newApplied(want int, timed bool) *applied {
	return &applied{want: int64(want), done: make(chan struct{}), timed: timed}
}

func (a *applied) add(data []byte) {
	if a.timed && len(data) >= 8 {
		sent := int64(binary.BigEndian.Uint64(data))
		ms := float64(time.Now().UnixNano()-sent) / 1e6
		a.mu.Lock()
		a.lat = append(a.lat, ms)
		a.mu.Unlock()
	}
	if a.n.Add(1) == a.want {
		close(a.done)
	}
}

// wait waits until every effect is applied, or until none has been for
// quiet: a slow machine gets there late, a stalled pipeline fails.
func (a *applied) wait(ctx context.Context, quiet time.Duration) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	last, since := a.n.Load(), time.Now()
	for {
		select {
		case <-a.done:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("%d of %d effects applied: %w", a.n.Load(), a.want, ctx.Err())
		case <-tick.C:
		}
		if n := a.n.Load(); n != last {
			last, since = n, time.Now()
		} else if time.Since(since) > quiet {
			return fmt.Errorf("%d of %d effects applied, and none for %v", n, a.want, quiet)
		}
	}
}

func (a *applied) latencies() []float64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.lat
}

// pipeline is a running pipeline, ready for jobs.
type pipeline struct {
	prod *worker.Producer
	stop func()
}

// startPipeline starts the leasehold or the raw pipeline under prefix.
func (e *env) startPipeline(ctx context.Context, raw bool, prefix string, ap *applied) (*pipeline, error) {
	return e.startPipelineWith(ctx, raw, prefix, ap, telemetry.Config{})
}

// startPipelineWith starts a pipeline whose producer, workers and sink
// runner report through tel (zero: the OpenTelemetry globals).
func (e *env) startPipelineWith(ctx context.Context, raw bool, prefix string, ap *applied, tel telemetry.Config) (*pipeline, error) {
	nc, js, err := e.connect("bench setup " + prefix)
	if err != nil {
		return nil, err
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: pipePartitions, Replicas: e.replicas()}); err != nil {
		e.release(nc)
		return nil, err
	}
	var stop func()
	if raw {
		stop, err = e.startRaw(ctx, js, prefix, ap)
	} else {
		stop, err = e.startLeasehold(ctx, js, prefix, ap, tel)
	}
	if err != nil {
		e.dropStreams(ctx, js, prefix+"-")
		e.release(nc)
		return nil, err
	}
	prod, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: pipePartitions, Telemetry: tel})
	if err != nil {
		stop()
		e.release(nc)
		return nil, err
	}
	return &pipeline{prod: prod, stop: func() {
		stop()
		e.dropStreams(ctx, js, prefix+"-")
		e.release(nc)
	}}, nil
}

// startLeasehold starts four workers and a stream sink runner applying to
// a memory sink, and waits until the workers hold their shares.
func (e *env) startLeasehold(ctx context.Context, js jetstream.JetStream, prefix string, ap *applied, tel telemetry.Config) (func(), error) {
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: prefix + "-leases", MarkerTTL: time.Second, Replicas: e.replicas()})
	if err != nil {
		return nil, err
	}
	var stops []func()
	stopAll := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	mem := sink.NewMemory(sink.MemoryConfig{Logger: e.quiet()})
	rnc, rjs, err := e.connect("bench sink " + prefix)
	if err != nil {
		return nil, err
	}
	runner, err := streamsink.New(ctx, rjs, streamsink.Config{
		Prefix:   prefix,
		Replicas: e.replicas(),
		Handler: func(ctx context.Context, eff sink.Effect) error {
			if err := mem.Apply(ctx, eff); err != nil {
				return err
			}
			ap.add(eff.Data)
			return nil
		},
		Telemetry: tel,
		Logger:    e.quiet(),
	})
	if err != nil {
		e.release(rnc)
		return nil, err
	}
	stops = append(stops, e.goRun(ctx, func(ctx context.Context) { _ = runner.Run(ctx) }, func() { e.release(rnc) }))

	var ws []*worker.Worker
	handler := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error { return j.Emit(ctx, j.Data) })
	for i := range pipeWorkers {
		wnc, wjs, err := e.connect(fmt.Sprintf("bench worker %s-%d", prefix, i))
		if err != nil {
			stopAll()
			return nil, err
		}
		w, err := worker.New(worker.Config{
			JetStream:   wjs,
			Prefix:      prefix,
			Partitions:  pipePartitions,
			Handler:     handler,
			Bucket:      bucket,
			FetchBatch:  pipeBatch,
			Coordinator: coordinator.Config{Worker: fmt.Sprintf("%s-w%d", prefix, i), RebalanceDelay: 50 * time.Millisecond, Logger: e.quiet()},
			Telemetry:   tel,
			Logger:      e.quiet(),
		})
		if err != nil {
			e.release(wnc)
			stopAll()
			return nil, err
		}
		ws = append(ws, w)
		stops = append(stops, e.goRun(ctx, func(ctx context.Context) { _ = w.Run(ctx) }, func() { e.release(wnc) }))
	}
	// Rebalancing moves partitions for a while after the first worker took
	// them all: wait until the shares hold still.
	stable := 0
	err = wait(ctx, time.Minute, "workers balance", func() bool {
		total, lo, hi := 0, pipePartitions, 0
		for _, w := range ws {
			n := len(w.Held())
			total, lo, hi = total+n, min(lo, n), max(hi, n)
		}
		if total == pipePartitions && hi-lo <= 1 {
			stable++
		} else {
			stable = 0
		}
		return stable >= 40
	})
	if err != nil {
		stopAll()
		return nil, err
	}
	return stopAll, nil
}

// goRun runs fn until the returned stop is called, then calls after.
func (e *env) goRun(ctx context.Context, fn func(context.Context), after func()) func() {
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(rctx)
	}()
	return func() {
		cancel()
		<-done
		if after != nil {
			after()
		}
	}
}

// startRaw starts the hand-written pipeline: per partition a durable pull
// consumer with explicit acks, fetched in batches; each job's effect is
// published without waiting, and the job acked when its PubAck arrives. A
// durable consumer on the effect stream applies each effect to a map
// (deduplicated by Nats-Msg-Id) and acks it.
func (e *env) startRaw(ctx context.Context, js jetstream.JetStream, prefix string, ap *applied) (func(), error) {
	var stops []func()
	stopAll := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	snc, sjs, err := e.connect("bench raw sink " + prefix)
	if err != nil {
		return nil, err
	}
	scons, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		return sjs.CreateOrUpdateConsumer(ctx, worker.EffectsStream(prefix), jetstream.ConsumerConfig{
			Durable: "raw-sink", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxAckPending: 10000,
		})
	})
	if err != nil {
		e.release(snc)
		return nil, err
	}
	store := &rawStore{data: map[string][]byte{}}
	stops = append(stops, e.goRun(ctx, func(ctx context.Context) { rawSink(ctx, scons, store, ap) }, func() { e.release(snc) }))
	for w := range pipeWorkers {
		// A publish whose answer is lost fails after a bound, as
		// leasehold's effects do after EffectTimeout, and its job is
		// redelivered at once instead of after AckWait.
		wnc, wjs, err := e.connect(fmt.Sprintf("bench raw worker %s-%d", prefix, w), jetstream.WithPublishAsyncTimeout(5*time.Second))
		if err != nil {
			stopAll()
			return nil, err
		}
		var parts []func(context.Context)
		for p := w; p < pipePartitions; p += pipeWorkers {
			part := leasehold.Partition(p)
			cons, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
				return wjs.CreateOrUpdateConsumer(ctx, worker.JobsStream(prefix), jetstream.ConsumerConfig{
					Durable:       fmt.Sprintf("raw-p%d", p),
					FilterSubject: worker.JobSubject(prefix, part),
					AckPolicy:     jetstream.AckExplicitPolicy,
					AckWait:       30 * time.Second,
					MaxAckPending: 10000,
				})
			})
			if err != nil {
				e.release(wnc)
				stopAll()
				return nil, err
			}
			out := worker.OutputSubject(prefix, part)
			parts = append(parts, func(ctx context.Context) { rawPartition(ctx, wjs, cons, out) })
		}
		stops = append(stops, e.goRun(ctx, func(ctx context.Context) {
			var wg sync.WaitGroup
			for _, run := range parts {
				wg.Add(1)
				go func() { defer wg.Done(); run(ctx) }()
			}
			wg.Wait()
		}, func() { e.release(wnc) }))
	}
	return stopAll, nil
}

type rawStore struct {
	mu   sync.Mutex
	data map[string][]byte
}

// rawSink applies effects as a hand-written consumer would: fetch a batch,
// apply each effect unless its ID was applied before, ack it.
func rawSink(ctx context.Context, cons jetstream.Consumer, store *rawStore, ap *applied) {
	for ctx.Err() == nil {
		batch, err := cons.Fetch(rawSinkBatch, jetstream.FetchMaxWait(500*time.Millisecond))
		if err != nil {
			continue
		}
		for m := range batch.Messages() {
			id := m.Headers().Get(jetstream.MsgIDHeader)
			store.mu.Lock()
			_, dup := store.data[id]
			if !dup {
				store.data[id] = m.Data()
			}
			store.mu.Unlock()
			if !dup {
				ap.add(m.Data())
			}
			_ = m.Ack()
		}
	}
}

// rawPartition runs one partition of the raw pipeline.
func rawPartition(ctx context.Context, js jetstream.JetStream, cons jetstream.Consumer, out string) {
	type pending struct {
		m   jetstream.Msg
		fut jetstream.PubAckFuture
	}
	acks := make(chan pending, 1000)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for p := range acks {
			select {
			case <-p.fut.Ok():
				_ = p.m.Ack()
			case <-p.fut.Err():
				// Refused or lost (a stream still electing its leader on
				// a cluster): have the server redeliver the job now, as a
				// hand-written worker would, rather than after AckWait.
				_ = p.m.Nak()
			}
		}
	}()
	defer wg.Wait()
	defer close(acks)
	for ctx.Err() == nil {
		// The wait is the server's: a fetch cut short by a context of
		// the client's drops the messages the server sent meanwhile,
		// which come back only after AckWait (30 s). That stalled whole
		// runs on a 3-node cluster; a tuned hand-written worker lets the
		// server end the request.
		batch, err := cons.Fetch(pipeBatch, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			continue
		}
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				_ = m.Nak()
				continue
			}
			msg := &nats.Msg{Subject: out, Data: m.Data(), Header: nats.Header{}}
			msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s.%d", out, md.Sequence.Stream))
			// With every write synced, the pending window can take longer
			// than the default stall wait of 200 ms to drain: wait for
			// room, as leasehold's worker does, rather than skip the job.
			fut, err := js.PublishMsgAsync(msg, jetstream.WithStallWait(30*time.Second))
			if err != nil {
				_ = m.Nak()
				continue
			}
			acks <- pending{m, fut}
		}
	}
}

// payload is a job's data: the send time, then padding.
func payload(sent time.Time) []byte {
	b := make([]byte, pipePayload)
	binary.BigEndian.PutUint64(b, uint64(sent.UnixNano()))
	return b
}

// enqueueAll sends n jobs, round robin over the partitions, in async
// batches of 1000.
func enqueueAll(ctx context.Context, prod *worker.Producer, n int) error {
	batch := prod.Batch()
	for i := range n {
		if err := batch.EnqueueTo(ctx, leasehold.Partition(i%pipePartitions), payload(time.Now())); err != nil {
			return err
		}
		if batch.Len() == 1000 {
			if _, err := batch.Wait(ctx); err != nil {
				return err
			}
		}
	}
	_, err := batch.Wait(ctx)
	return err
}

// enqueuePaced sends jobs at rate per second for d, in small batches every
// 5ms, and returns how many it sent.
func enqueuePaced(ctx context.Context, prod *worker.Producer, rate float64, d time.Duration) (int, error) {
	const tick = 5 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	start := time.Now()
	sent := 0
	for time.Since(start) < d {
		due := int(rate * time.Since(start).Seconds())
		if due > sent {
			batch := prod.Batch()
			for ; sent < due; sent++ {
				if err := batch.EnqueueTo(ctx, leasehold.Partition(sent%pipePartitions), payload(time.Now())); err != nil {
					return sent, err
				}
			}
			if _, err := batch.Wait(ctx); err != nil {
				return sent, err
			}
		}
		select {
		case <-ctx.Done():
			return sent, ctx.Err()
		case <-t.C:
		}
	}
	return sent, nil
}

// throughput runs one pipeline over n jobs and returns jobs per second,
// from the first enqueue to the last effect applied.
func (e *env) throughput(ctx context.Context, raw bool, prefix string, n int) (float64, error) {
	return e.throughputWith(ctx, raw, prefix, n, telemetry.Config{})
}

// throughputWith is throughput with the pipeline reporting through tel.
func (e *env) throughputWith(ctx context.Context, raw bool, prefix string, n int, tel telemetry.Config) (float64, error) {
	ap := newApplied(n, false)
	p, err := e.startPipelineWith(ctx, raw, prefix, ap, tel)
	if err != nil {
		return 0, err
	}
	defer p.stop()
	t0 := time.Now()
	if err := enqueueAll(ctx, p.prod, n); err != nil {
		return 0, err
	}
	if err := ap.wait(ctx, time.Minute); err != nil {
		return 0, fmt.Errorf("pipeline %s: %w", prefix, err)
	}
	return float64(n) / time.Since(t0).Seconds(), nil
}

// paced runs one pipeline at rate jobs/s for d and returns the latencies
// from enqueue to applied effect, in milliseconds.
func (e *env) paced(ctx context.Context, raw bool, prefix string, rate float64, d time.Duration) ([]float64, error) {
	ap := newApplied(-1, true)
	p, err := e.startPipeline(ctx, raw, prefix, ap)
	if err != nil {
		return nil, err
	}
	defer p.stop()
	n, err := enqueuePaced(ctx, p.prod, rate, d)
	if err != nil {
		return nil, err
	}
	err = wait(ctx, time.Minute, "the paced jobs' effects", func() bool { return ap.n.Load() >= int64(n) })
	return ap.latencies(), err
}

func (e *env) pipeJobs() int {
	if e.cfg.Quick {
		return 3000
	}
	return 30000
}

// endToEnd measures both pipelines' throughput, interleaved.
func (e *env) endToEnd(ctx context.Context) ([]Row, error) {
	n := e.pipeJobs()
	var lh, raw, lhCPU, rawCPU []float64
	for i := range e.cfg.Runs {
		order := []bool{true, false} // raw first on even runs
		if i%2 == 1 {
			order = []bool{false, true}
		}
		for _, isRaw := range order {
			name := fmt.Sprintf("e2e-lh%d", i)
			if isRaw {
				name = fmt.Sprintf("e2e-raw%d", i)
			}
			label := "leasehold"
			if isRaw {
				label = "raw"
			}
			var r, cpu float64
			var err error
			// The label tells the pipelines apart in a CPU profile (go
			// tool pprof -tagfocus pipeline=raw) for the goroutines the
			// run starts, its connections' included: not the server's.
			pprof.Do(ctx, pprof.Labels("pipeline", label), func(ctx context.Context) {
				cpu0 := cpuTime()
				r, err = e.throughput(ctx, isRaw, name, n)
				cpu = (cpuTime() - cpu0).Seconds() * 1e6 / float64(n)
			})
			if err != nil {
				return nil, err
			}
			if isRaw {
				raw, rawCPU = append(raw, r), append(rawCPU, cpu)
			} else {
				lh, lhCPU = append(lh, r), append(lhCPU, cpu)
			}
		}
		e.progress("e2e run %d: leasehold %.0f jobs/s %.0f µs CPU/job, raw %.0f jobs/s %.0f µs CPU/job", i+1, lh[i], lhCPU[i], raw[i], rawCPU[i])
	}
	// The latency rows pace both pipelines at half the slower one's
	// maximum, so that neither queues.
	e.maxRate = min(median(lh), median(raw))
	return []Row{
		paired("e2e_throughput", "jobs/s", lh, raw,
			fmt.Sprintf("%d jobs of %d B, %d partitions, %d workers, stream sink runner into memory; baseline: raw JetStream, same hops and acks; target ratio >= 0.9", n, pipePayload, pipePartitions, pipeWorkers)),
		paired("e2e_cpu", "µs CPU/job", lhCPU, rawCPU, "CPU time of this process (the servers, producer, workers and sink) per job in the e2e_throughput runs; baseline: the raw pipeline. On a shared machine this holds better than throughput"),
	}, nil
}

// latency measures enqueue-to-applied latency at half of leasehold's
// maximum throughput, for both pipelines at the same rate, interleaved.
func (e *env) latency(ctx context.Context) ([]Row, error) {
	if e.maxRate == 0 {
		r, err := e.throughput(ctx, false, "lat-max", e.pipeJobs())
		if err != nil {
			return nil, err
		}
		e.maxRate = r
	}
	rate := e.maxRate / 2
	d := 5 * time.Second
	if e.cfg.Quick {
		d = time.Second
	}
	var lh50, lh99, raw50, raw99 []float64
	for i := range e.cfg.Runs {
		order := []bool{true, false}
		if i%2 == 1 {
			order = []bool{false, true}
		}
		for _, isRaw := range order {
			name := fmt.Sprintf("lat-lh%d", i)
			if isRaw {
				name = fmt.Sprintf("lat-raw%d", i)
			}
			lat, err := e.paced(ctx, isRaw, name, rate, d)
			if err != nil {
				return nil, err
			}
			if isRaw {
				raw50, raw99 = append(raw50, percentile(lat, 0.5)), append(raw99, percentile(lat, 0.99))
			} else {
				lh50, lh99 = append(lh50, percentile(lat, 0.5)), append(lh99, percentile(lat, 0.99))
			}
		}
		e.progress("latency run %d at %.0f jobs/s: leasehold p50 %.1f ms p99 %.1f ms, raw p50 %.1f ms p99 %.1f ms", i+1, rate, lh50[i], lh99[i], raw50[i], raw99[i])
	}
	note := fmt.Sprintf("enqueue to applied effect at %.0f jobs/s (half of the slower pipeline's measured maximum) for %v per run; baseline: raw pipeline at the same rate; target p99 ratio <= 1.2", rate, d)
	return []Row{
		paired("e2e_latency_p50", "ms", lh50, raw50, note),
		paired("e2e_latency_p99", "ms", lh99, raw99, note),
	}, nil
}
