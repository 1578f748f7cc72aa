package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// aonEffects is how many effects each job of the all-or-none rows emits:
// without packing, the worker holds the last back until the handler
// returns, and the stream sink holds the first two until the last is in
// the log; with packing, the worker holds all three and sends them as one
// message.
const aonEffects = 3

// endToEndAll measures the end-to-end row and, beside it, the same
// pipeline with jobs of aonEffects effects each, applied all or none.
func (e *env) endToEndAll(ctx context.Context) ([]Row, error) {
	rows, err := e.endToEnd(ctx)
	if err != nil {
		return rows, err
	}
	aon, err := e.allOrNone(ctx)
	return append(rows, aon...), err
}

// aonVariant is one pipeline of the all-or-none rows: jobs of k effects,
// packed or not.
type aonVariant struct {
	k    int
	pack bool
}

// allOrNone measures jobs per second with aonEffects effects per job,
// packed (worker.Config.PackEffects) and not, against jobs of one
// effect, interleaved, all through leasehold.
func (e *env) allOrNone(ctx context.Context) ([]Row, error) {
	n := e.pipeJobs()
	variants := []aonVariant{{aonEffects, true}, {1, false}, {aonEffects, false}}
	got := make([][]float64, len(variants))
	cpu := make([][]float64, len(variants)) // µs an effect
	for i := range e.cfg.Runs {
		// Each run measures all three, starting from another each time, so
		// that the machine's drift weighs on each alike.
		for j := range variants {
			v := (i + j) % len(variants)
			cpu0 := cpuTime()
			r, err := e.aonThroughput(ctx, fmt.Sprintf("aon%d%s-%d", variants[v].k, packName(variants[v].pack), i), n, variants[v].k, variants[v].pack)
			if err != nil {
				return nil, err
			}
			got[v] = append(got[v], r)
			cpu[v] = append(cpu[v], (cpuTime()-cpu0).Seconds()*1e6/float64(n*variants[v].k))
		}
		e.progress("all-or-none run %d: %d effects a job packed %.0f jobs/s %.1f µs CPU/effect, unpacked %.0f jobs/s, one effect %.0f jobs/s %.1f µs CPU/effect",
			i+1, aonEffects, got[0][i], cpu[0][i], got[2][i], got[1][i], cpu[1][i])
	}
	packed, one, plain := got[0], got[1], got[2]
	return []Row{
		paired("e2e_throughput_all_or_none", "jobs/s", packed, one,
			fmt.Sprintf("end-to-end with all-or-none effects: %d jobs of %d effects of %d B each, packed in one message a job (worker.Config.PackEffects), %d partitions, %d workers, stream sink runner into memory; baseline: the same pipeline with one effect a job",
				n, aonEffects, pipePayload, pipePartitions, pipeWorkers)),
		paired("e2e_throughput_all_or_none_unpacked", "jobs/s", plain, one,
			fmt.Sprintf("the all-or-none row without packing: %d jobs of %d effects, one message each (%dx the effect messages of the baseline, the same one-effect pipeline, measured in the same runs)",
				n, aonEffects, aonEffects)),
		paired("e2e_cpu_all_or_none", "µs CPU/effect", cpu[0], cpu[1],
			"CPU time of this process (the server, producer, workers and sink) per effect in the packed all-or-none runs; baseline: the one-effect runs. On a shared machine this holds better than throughput: 2.5 times the effects per CPU second of one-effect jobs is a ratio of 0.4"),
	}, nil
}

func packName(pack bool) string {
	if pack {
		return "p"
	}
	return ""
}

// aonThroughput runs the leasehold pipeline with jobs of k effects,
// packed or not, and returns jobs per second, from the first enqueue to
// the last effect applied.
func (e *env) aonThroughput(ctx context.Context, prefix string, n, k int, pack bool) (float64, error) {
	r, _, err := e.aonRun(ctx, prefix, n, k, pack, false)
	return r, err
}

// aonRun is aonThroughput, and with lag it also returns the share of the
// effects the sink had applied when the log first held them all: near 1,
// the sink kept up and the workers set the pace; well below, the sink
// did, and the rest of the run was the sink catching up.
func (e *env) aonRun(ctx context.Context, prefix string, n, k int, pack, lag bool) (float64, float64, error) {
	ap := newApplied(n*k, false)
	nc, js, err := e.connect("bench setup " + prefix)
	if err != nil {
		return 0, 0, err
	}
	defer e.release(nc)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: pipePartitions, Replicas: e.replicas()}); err != nil {
		return 0, 0, err
	}
	defer e.dropStreams(ctx, js, prefix+"-")
	stop, err := e.startAON(ctx, js, prefix, ap, k, pack)
	if err != nil {
		return 0, 0, err
	}
	defer stop()
	prod, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: pipePartitions})
	if err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	if err := enqueueAll(ctx, prod, n); err != nil {
		return 0, 0, err
	}
	share := make(chan float64, 1)
	if lag {
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		// A job's effects are one message when packed.
		msgs := int64(n * k)
		if pack && k > 1 {
			msgs = int64(n)
		}
		go func() { share <- appliedWhenStored(wctx, js, worker.EffectsStream(prefix), ap, msgs) }()
	}
	if err := ap.wait(ctx, time.Minute); err != nil {
		return 0, 0, fmt.Errorf("pipeline %s: %w", prefix, err)
	}
	rate := float64(n) / time.Since(t0).Seconds()
	if !lag {
		return rate, 0, nil
	}
	return rate, <-share, nil
}

// startAON starts the pipeline of startLeasehold with a handler that
// emits k effects a job, packed or not.
func (e *env) startAON(ctx context.Context, js jetstream.JetStream, prefix string, ap *applied, k int, pack bool) (func(), error) {
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
		BatchHandler: func(ctx context.Context, effs []sink.Effect) error {
			if err := mem.Apply(ctx, effs...); err != nil {
				return err
			}
			for _, eff := range effs {
				ap.add(eff.Data)
			}
			return nil
		},
		Logger: e.quiet(),
	})
	if err != nil {
		e.release(rnc)
		return nil, err
	}
	stops = append(stops, e.goRun(ctx, func(ctx context.Context) { _ = runner.Run(ctx) }, func() { e.release(rnc) }))
	handler := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		for range k {
			if err := j.Emit(ctx, j.Data); err != nil {
				return err
			}
		}
		return nil
	})
	var ws []*worker.Worker
	for i := range pipeWorkers {
		wnc, wjs, err := e.connect(fmt.Sprintf("bench worker %s-%d", prefix, i))
		if err != nil {
			stopAll()
			return nil, err
		}
		w, err := worker.New(worker.Config{
			JetStream: wjs, Prefix: prefix, Partitions: pipePartitions, Handler: handler, Bucket: bucket, FetchBatch: pipeBatch,
			PackEffects: pack,
			Coordinator: coordinator.Config{Worker: fmt.Sprintf("%s-w%d", prefix, i), RebalanceDelay: 50 * time.Millisecond, Logger: e.quiet()},
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

// appliedWhenStored polls the effects stream until it holds msgs
// messages, the effects ap waits for, and returns the share of them
// applied by then (1 when ctx ends first).
func appliedWhenStored(ctx context.Context, js jetstream.JetStream, stream string, ap *applied, msgs int64) float64 {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return 1
		case <-tick.C:
		}
		applied := ap.n.Load()
		st, err := js.Stream(ctx, stream)
		if err != nil {
			continue
		}
		info, err := st.Info(ctx)
		if err == nil && int64(info.State.Msgs) >= msgs {
			return float64(applied) / float64(ap.want)
		}
	}
}
