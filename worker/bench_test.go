package worker_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

const (
	benchPartitions = 16
	benchWorkers    = 4
	benchJobs       = 30000
	benchPayload    = 256
)

// BenchmarkEndToEnd runs the same jobs through a hand-written raw
// JetStream pipeline and through leasehold, alternately in every
// iteration, on one server over loopback TCP: a producer enqueues while
// workers pull, run a handler that publishes one effect, and a consumer
// reads the effects. It reports each pipeline's median jobs/s over the
// iterations and the median of the per-iteration ratios.
//
//	go test -run '^$' -bench 'EndToEnd|Backlog' -benchtime 5x -count 3 ./worker/
func BenchmarkEndToEnd(b *testing.B) { benchPipelines(b, false) }

// BenchmarkBacklog is BenchmarkEndToEnd with the jobs enqueued before the
// clock starts, so that the workers, not the producer, set the pace: the
// handlers are held at a gate until every job is stored.
func BenchmarkBacklog(b *testing.B) { benchPipelines(b, true) }

// BenchmarkPipelineAlone runs each pipeline of BenchmarkEndToEnd alone:
// a profile of one of its sub-benchmarks holds that side's samples only,
// and two builds of one side compare by its medians of CPU and
// allocations per job, the binaries run alternately:
//
//	go test -c -o worker.test ./worker/
//	./worker.test -test.run '^$' -test.bench 'PipelineAlone/leasehold' -test.benchtime 3x -test.cpuprofile cpu.out
func BenchmarkPipelineAlone(b *testing.B) {
	for _, name := range []string{"raw", "leasehold"} {
		b.Run(name, func(b *testing.B) {
			srv := natstest.Start(b, natstest.Listen())
			payload := make([]byte, benchPayload)
			var cpu, allocs []float64
			b.StopTimer()
			for i := range b.N {
				var p pace
				if name == "raw" {
					p = rawPipeline(b, srv, fmt.Sprintf("raw%d", i), payload, false)
				} else {
					p = leaseholdPipeline(b, srv, fmt.Sprintf("lh%d", i), payload, false, telemetry.Config{})
				}
				cpu, allocs = append(cpu, float64(p.cpuPerJob.Nanoseconds())/1e3), append(allocs, p.allocsPerJob)
			}
			b.ReportMetric(median(cpu), "cpu_us/job")
			b.ReportMetric(median(allocs), "allocs/job")
			b.ReportMetric(0, "ns/op")
		})
	}
}

func benchPipelines(b *testing.B, backlog bool) {
	srv := natstest.Start(b, natstest.Listen())
	payload := make([]byte, benchPayload)
	var raw, lh, ratios, rawCPU, lhCPU, cpuRatios, rawAllocs, lhAllocs []float64
	b.StopTimer()
	for i := range b.N {
		// Each iteration measures both, back to back and in alternating
		// order, so that the machine's drift weighs on both alike; the
		// ratio is taken per iteration.
		var r, l pace
		if i%2 == 0 {
			r = rawPipeline(b, srv, fmt.Sprintf("raw%d", i), payload, backlog)
			l = leaseholdPipeline(b, srv, fmt.Sprintf("lh%d", i), payload, backlog, telemetry.Config{})
		} else {
			l = leaseholdPipeline(b, srv, fmt.Sprintf("lh%d", i), payload, backlog, telemetry.Config{})
			r = rawPipeline(b, srv, fmt.Sprintf("raw%d", i), payload, backlog)
		}
		raw, lh, ratios = append(raw, r.rate), append(lh, l.rate), append(ratios, l.rate/r.rate)
		rawCPU, lhCPU = append(rawCPU, float64(r.cpuPerJob.Microseconds())), append(lhCPU, float64(l.cpuPerJob.Microseconds()))
		cpuRatios = append(cpuRatios, float64(l.cpuPerJob)/float64(r.cpuPerJob))
		rawAllocs, lhAllocs = append(rawAllocs, r.allocsPerJob), append(lhAllocs, l.allocsPerJob)
	}
	b.ReportMetric(median(raw), "raw_jobs/s")
	b.ReportMetric(median(lh), "leasehold_jobs/s")
	b.ReportMetric(median(ratios), "ratio")
	b.ReportMetric(median(rawCPU), "raw_cpu_us/job")
	b.ReportMetric(median(lhCPU), "leasehold_cpu_us/job")
	b.ReportMetric(median(cpuRatios), "cpu_ratio")
	b.ReportMetric(median(rawAllocs), "raw_allocs/job")
	b.ReportMetric(median(lhAllocs), "leasehold_allocs/job")
	b.ReportMetric(0, "ns/op")
}

// pace is how fast a pipeline went: jobs per second, and the CPU time the
// whole process (the embedded server included) spent per job, which the
// machine's other load disturbs less than the rate, and the heap
// allocations it made per job, which the load does not disturb at all.
type pace struct {
	rate         float64
	cpuPerJob    time.Duration
	allocsPerJob float64
}

// timed enqueues benchJobs jobs and waits for their effects, timing either
// the whole (end to end) or, with backlog, only what follows the opening of
// the gate.
func timed(b *testing.B, prod *worker.Producer, payload []byte, r *reader, gate chan struct{}, backlog bool) pace {
	b.Helper()
	enqueue := func() {
		enqueueBench(b, func(ctx context.Context, batch *worker.Batch, i int) error {
			return batch.Enqueue(ctx, fmt.Appendf(nil, "key-%d", i), payload)
		}, prod.Batch)
	}
	if backlog {
		enqueue()
	}
	b.StartTimer()
	cpu0, allocs0 := cpuTime(), mallocs()
	t0 := time.Now()
	close(gate)
	if !backlog {
		enqueue()
	}
	r.wait(b)
	took := time.Since(t0)
	cpu, allocs := cpuTime()-cpu0, mallocs()-allocs0
	b.StopTimer()
	return pace{rate: float64(benchJobs) / took.Seconds(), cpuPerJob: cpu / benchJobs, allocsPerJob: float64(allocs) / benchJobs}
}

// mallocs is the number of heap objects the process has allocated.
func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}

// cpuTime is the user and system time the process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func provisionBench(b *testing.B, js jetstream.JetStream, prefix string) {
	b.Helper()
	if err := worker.ProvisionJobs(ctxFor(b, 30*time.Second), js, worker.JobsConfig{Prefix: prefix, Partitions: benchPartitions}); err != nil {
		b.Fatal(err)
	}
}

// leaseholdPipeline starts four workers, waits until they hold every
// partition, and times benchJobs jobs from enqueue to their effects. The
// workers and the producer record through tc.
func leaseholdPipeline(b *testing.B, srv *natstest.Server, prefix string, payload []byte, backlog bool, tc telemetry.Config) pace {
	b.Helper()
	js := srv.JetStream(b)
	provisionBench(b, js, prefix)
	bucket, err := coordinator.Provision(ctxFor(b, 30*time.Second), js, coordinator.BucketConfig{Bucket: prefix + "-leases", MarkerTTL: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	var ready atomic.Int64
	readyCh := make(chan struct{})
	obs := worker.ObserverFunc(func(_ context.Context, e worker.Event) {
		if e.Kind == worker.EventPartitionReady && ready.Add(1) == benchPartitions {
			close(readyCh)
		}
	})
	gate := make(chan struct{})
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		<-gate
		return j.Emit(ctx, j.Data)
	})
	var ws []*running
	for i := range benchWorkers {
		cfg := worker.Config{
			JetStream:   srv.JetStream(b),
			Prefix:      prefix,
			Partitions:  benchPartitions,
			Handler:     h,
			Bucket:      bucket,
			Coordinator: coordinator.Config{Worker: fmt.Sprintf("%s-w%d", prefix, i), RebalanceDelay: 50 * time.Millisecond},
			Logger:      testLogger(),
			Observer:    obs,
			Telemetry:   tc,
		}

		ws = append(ws, start(b, cfg))
	}
	select {
	case <-readyCh:
	case <-time.After(time.Minute):
		b.Fatal("workers did not take every partition")
	}
	// Let the group settle: rebalancing moves partitions for a while
	// after the first worker took them all.
	waitBalanced(b, ws)
	prod, err := worker.NewProducer(srv.JetStream(b), worker.ProducerConfig{Prefix: prefix, Partitions: benchPartitions, Telemetry: tc})
	if err != nil {
		b.Fatal(err)
	}
	reader := startReader(b, srv.JetStream(b), worker.EffectsStream(prefix), benchJobs+benchPartitions)
	p := timed(b, prod, payload, reader, gate, backlog)
	for _, w := range ws {
		w.stop(b)
	}
	return p
}

// waitBalanced waits until each worker holds its share of partitions, and
// a moment longer so that pending hand-offs finish.
func waitBalanced(b *testing.B, ws []*running) {
	b.Helper()
	deadline := time.Now().Add(time.Minute)
	stable := 0
	for stable < 5 {
		total, lo, hi := 0, benchPartitions, 0
		for _, w := range ws {
			n := len(w.w.Held())
			total += n
			lo, hi = min(lo, n), max(hi, n)
		}
		if total == benchPartitions && hi-lo <= 1 {
			stable++
		} else {
			stable = 0
		}
		if time.Now().After(deadline) {
			b.Fatal("workers did not balance")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// enqueueBench sends benchJobs jobs in async batches of 1000.
func enqueueBench(b *testing.B, send func(context.Context, *worker.Batch, int) error, newBatch func() *worker.Batch) {
	b.Helper()
	ctx := ctxFor(b, time.Minute)
	batch := newBatch()
	for i := range benchJobs {
		if err := send(ctx, batch, i); err != nil {
			b.Fatal(err)
		}
		if batch.Len() == 1000 {
			if _, err := batch.Wait(ctx); err != nil {
				b.Fatal(err)
			}
		}
	}
	if _, err := batch.Wait(ctx); err != nil {
		b.Fatal(err)
	}
}

// reader counts the messages of a stream as they arrive.
type reader struct {
	want   int
	n      atomic.Int64
	done   chan struct{}
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func startReader(b *testing.B, js jetstream.JetStream, stream string, want int) *reader {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &reader{want: want, done: make(chan struct{}), cancel: cancel}
	c, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		n := 0
		for ctx.Err() == nil {
			// Ask for no more than is missing, so the last pull ends with
			// the last message instead of waiting out its expiry.
			batch, err := c.Fetch(min(1000, want-n), jetstream.FetchMaxWait(200*time.Millisecond))
			if err != nil {
				continue
			}
			for range batch.Messages() {
				n++
			}
			r.n.Store(int64(n))
			if n >= want {
				close(r.done)
				return
			}
		}
	}()
	b.Cleanup(func() { cancel(); r.wg.Wait() })
	return r
}

func (r *reader) wait(b *testing.B) {
	b.Helper()
	select {
	case <-r.done:
	case <-time.After(2 * time.Minute):
		b.Fatalf("%d of %d effects arrived", r.n.Load(), r.want)
	}
}

// rawPipeline is the same work hand-written on JetStream: one durable pull
// consumer with explicit acks per partition, four workers each pulling four
// partitions in batches of 100, publishing one effect per job without
// waiting, and acking each job once its effect's PubAck arrives.
func rawPipeline(b *testing.B, srv *natstest.Server, prefix string, payload []byte, backlog bool) pace {
	b.Helper()
	gate := make(chan struct{})
	js := srv.JetStream(b)
	provisionBench(b, js, prefix)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range benchWorkers {
		wjs := srv.JetStream(b)
		for p := w; p < benchPartitions; p += benchWorkers {
			cons, err := wjs.CreateOrUpdateConsumer(ctxFor(b, 10*time.Second), worker.JobsStream(prefix), jetstream.ConsumerConfig{
				Durable:       fmt.Sprintf("p%d", p),
				FilterSubject: worker.JobSubject(prefix, leasehold.Partition(p)),
				AckPolicy:     jetstream.AckExplicitPolicy,
				AckWait:       30 * time.Second,
				MaxAckPending: 10000,
			})
			if err != nil {
				b.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				rawPartition(ctx, wjs, cons, worker.OutputSubject(prefix, leasehold.Partition(p)), gate)
			}()
		}
	}
	reader := startReader(b, srv.JetStream(b), worker.EffectsStream(prefix), benchJobs)
	pjs := srv.JetStream(b)
	prod, err := worker.NewProducer(pjs, worker.ProducerConfig{Prefix: prefix, Partitions: benchPartitions})
	if err != nil {
		b.Fatal(err)
	}

	p := timed(b, prod, payload, reader, gate, backlog)
	cancel()
	wg.Wait()
	return p
}

func rawPartition(ctx context.Context, js jetstream.JetStream, cons jetstream.Consumer, out string, gate chan struct{}) {
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
			}
		}
	}()
	defer wg.Wait()
	defer close(acks)
	for ctx.Err() == nil {
		fctx, cancel := context.WithTimeout(ctx, time.Second)
		batch, err := cons.Fetch(100, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			continue
		}
		for m := range batch.Messages() {
			<-gate
			md, _ := m.Metadata()
			msg := &nats.Msg{Subject: out, Data: m.Data(), Header: nats.Header{}}
			msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s.%d", out, md.Sequence.Stream))
			fut, err := js.PublishMsgAsync(msg)
			if err != nil {
				continue
			}
			acks <- pending{m, fut}
		}
		cancel()
	}
}
