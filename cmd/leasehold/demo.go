package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/embedded"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

type demoConfig struct {
	duration   time.Duration
	workers    int
	partitions int
	jobs       int
	otlp       string
	json       bool
	ttl        time.Duration
	workTime   time.Duration
	live       bool // refresh a table on a terminal; plain lines otherwise
}

func newDemo() *cobra.Command {
	var c demoConfig
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Watch workers share partitions, a worker freeze and come back as a zombie, and the fence refuse it",
		Long: `demo needs no setup: it starts a NATS server with JetStream inside this process,
a producer, several worker processes and a fenced KV sink. Mid-run it freezes
one worker (SIGSTOP) for longer than its lease TTL, so the others take its
partitions with higher epochs, then resumes it (SIGCONT): the frozen worker
wakes up in the middle of a job and writes with its old epoch, and the sink
refuses the write. A live view shows the partitions, the job progress, each
take-over (partition, old -> new holder, epoch) and the refused zombie writes;
a summary follows. Nothing is lost and nothing stale is applied. Epochs are
shown by their last 4 digits ("…1234"); --json gives the full value beside.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := c.validate(); err != nil {
				return err
			}
			c.live = isTerminal(cmd.OutOrStdout()) && !c.json
			if c.workTime == 0 {
				// Busy partitions make the freeze land in the middle of
				// jobs, where a paused process writes when it wakes up.
				perPartition := float64(c.jobs) / (c.duration / 2).Seconds() / float64(c.partitions)
				c.workTime = min(time.Duration(0.6/perPartition*float64(time.Second)), time.Second).Round(time.Millisecond)
			}
			sum, err := runDemo(cmd.Context(), cmd.OutOrStdout(), c)
			if err != nil {
				return err
			}
			if c.json {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(sum)
			}
			printSummary(cmd.OutOrStdout(), sum)
			if sum.JobsLost > 0 || sum.StaleApplied > 0 {
				return fmt.Errorf("the run broke an invariant: %d jobs lost, %d stale effects applied", sum.JobsLost, sum.StaleApplied)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.DurationVar(&c.duration, "duration", 30*time.Second, "how long to run at most")
	fs.IntVar(&c.workers, "workers", 3, "worker processes")
	fs.IntVar(&c.partitions, "partitions", 8, "partitions of the job stream")
	fs.IntVar(&c.jobs, "jobs", 2000, "jobs to enqueue, spread over the first half of the run")
	fs.StringVar(&c.otlp, "otlp", "", "send traces to this OTLP/HTTP endpoint (for example http://127.0.0.1:4318)")
	fs.BoolVar(&c.json, "json", false, "print only the summary, as one JSON object")
	fs.DurationVar(&c.ttl, "ttl", 2*time.Second, "lease TTL of the workers (whole seconds)")
	fs.DurationVar(&c.workTime, "work-time", 0, "time each job takes (default: enough to keep the partitions about 60% busy)")
	_ = fs.MarkHidden("work-time")
	return cmd
}

func (c demoConfig) validate() error {
	var errs []error
	if c.workers < 2 || c.workers > 16 {
		errs = append(errs, errors.New("--workers: use 2 to 16 (one of them is frozen mid-run)"))
	}
	if c.partitions < 1 || c.partitions > 256 {
		errs = append(errs, errors.New("--partitions: use 1 to 256"))
	}
	if c.jobs < 1 {
		errs = append(errs, errors.New("--jobs: use at least 1"))
	}
	if c.ttl < time.Second || c.ttl%time.Second != 0 {
		errs = append(errs, errors.New("--ttl: whole seconds, at least 1s"))
	}
	if min := 4*c.ttl + 10*time.Second; c.duration < min {
		errs = append(errs, fmt.Errorf("--duration: at least %v with a %v TTL, so the frozen worker can lose its lease and come back", min, c.ttl))
	}
	return errors.Join(errs...)
}

// demo holds the run's shared state.
type demo struct {
	cfg   demoConfig
	start time.Time
	out   io.Writer

	mu           sync.Mutex
	enqueued     map[string]demoJob // effect key -> the job
	perPart      map[leasehold.Partition][]uint64
	accepted     int
	duplicates   int
	stale        []rejection
	staleApplied int
	maxSeen      map[leasehold.Partition]leasehold.Epoch // in log order: barriers and accepted effects
	holder       map[leasehold.Partition]string          // the writer of maxSeen
	takeovers    []takeover
	applied      map[string]bool
	events       []string
	paused       string
	pauses       int
	pausedAt     time.Time
	pausedParts  []leasehold.Partition
	pausedEpoch  map[leasehold.Partition]leasehold.Epoch
	recovered    map[leasehold.Partition]time.Time
	failover     time.Duration
}

func (d *demo) since() string { return time.Since(d.start).Round(100 * time.Millisecond).String() }

func (d *demo) note(format string, args ...any) {
	line := fmt.Sprintf("%7s  ", d.since()) + fmt.Sprintf(format, args...)
	d.mu.Lock()
	d.events = append(d.events, line)
	if len(d.events) > 8 {
		d.events = d.events[len(d.events)-8:]
	}
	d.mu.Unlock()
	if !d.cfg.live && !d.cfg.json {
		fmt.Fprintln(d.out, line)
	}
}

// Decided sees every decision of the sink runner, in log order.
func (d *demo) Decided(_ context.Context, dec sink.Decision) {
	p, e := dec.Stamp.Partition, dec.Stamp.Epoch
	d.mu.Lock()
	switch dec.Outcome {
	case sink.Advanced:
		if e <= d.maxSeen[p] {
			break
		}
		d.maxSeen[p] = e
		prev, now := d.holder[p], dec.Stamp.Worker
		d.holder[p] = now
		if prev == "" || prev == now {
			break
		}
		tk := takeover{At: d.since(), Partition: uint32(p), From: prev, To: now, Epoch: uint64(e), EpochShort: shortEpoch(e)}
		d.takeovers = append(d.takeovers, tk)
		why := ""
		if prev == d.paused {
			why = " (the frozen worker's lease expired)"
		}
		d.mu.Unlock()
		d.note("TAKE-OVER partition %d: %s -> %s, epoch %s%s", p, prev, now, tk.EpochShort, why)
		return
	case sink.Accepted:
		// Checked here independently of the sink: nothing below the
		// partition's maximum may be applied.
		if e < d.maxSeen[p] {
			d.staleApplied++
		}
		if e > d.maxSeen[p] {
			d.maxSeen[p] = e
			d.holder[p] = dec.Stamp.Worker
		}
		d.accepted++
		d.applied[dec.Stamp.Key] = true
		d.noteRecovery(p, e)
	case sink.Duplicate:
		d.duplicates++
	case sink.Stale:
		r := rejection{At: d.since(), Partition: uint32(p), Epoch: uint64(e), EpochShort: shortEpoch(e), Max: uint64(dec.Max), MaxShort: shortEpoch(dec.Max),
			Worker: dec.Stamp.Worker, Key: dec.Stamp.Key}
		d.stale = append(d.stale, r)
		d.mu.Unlock()
		d.note("REFUSED zombie write from %s: partition %d epoch %s is below %s (key %s)", r.Worker, p, r.EpochShort, r.MaxShort, r.Key)
		return
	}
	d.mu.Unlock()
}

func runDemo(ctx context.Context, out io.Writer, cfg demoConfig) (demoSummary, error) {
	d := &demo{
		cfg: cfg, start: time.Now(), out: out,
		enqueued: map[string]demoJob{}, perPart: map[leasehold.Partition][]uint64{},
		maxSeen: map[leasehold.Partition]leasehold.Epoch{}, holder: map[leasehold.Partition]string{}, applied: map[string]bool{},
		pausedEpoch: map[leasehold.Partition]leasehold.Epoch{}, recovered: map[leasehold.Partition]time.Time{},
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir, err := os.MkdirTemp("", "leasehold-demo-")
	if err != nil {
		return demoSummary{}, err
	}
	defer os.RemoveAll(dir)
	var stops stack
	defer stops.run()

	srv, err := embedded.Start(embedded.Config{Name: "demo", StoreDir: filepath.Join(dir, "nats"), Listen: true})
	if err != nil {
		return demoSummary{}, err
	}
	stops.push(func() { srv.Shutdown(); srv.WaitForShutdown() })
	url := srv.ClientURL()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		return demoSummary{}, fmt.Errorf("connect to the embedded server: %w", err)
	}
	stops.push(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		return demoSummary{}, err
	}
	tel, _, shutdownTel, err := telemetry.Setup(ctx, telemetry.SetupConfig{
		OTLPEndpoint:       cfg.otlp,
		ResourceAttributes: []attribute.KeyValue{semconv.ServiceInstanceID("demo-sink")},
		NoGlobals:          true,
	})
	if err != nil {
		return demoSummary{}, err
	}
	stops.push(func() { flushTelemetry(shutdownTel, quiet) })
	const prefix = "leasehold"
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: 5 * time.Second})
	if err != nil {
		return demoSummary{}, err
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: cfg.partitions}); err != nil {
		return demoSummary{}, err
	}
	kv, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "leasehold-sink", Logger: quiet, Telemetry: destinationTelemetry(tel.Config())})
	if err != nil {
		return demoSummary{}, err
	}
	runner, err := streamsink.New(ctx, js, streamsink.Config{
		Prefix:    prefix,
		Name:      "kv",
		Verifier:  bucket,
		Observer:  d,
		Logger:    quiet,
		Telemetry: tel.Config(),
		// One atomic KV batch per fetched batch; the sink keys effects by
		// idempotency key.
		BatchHandler: func(ctx context.Context, effects []sink.Effect) error {
			for i := range effects {
				effects[i].Subject = effects[i].Stamp.Key
			}
			for len(effects) > 0 {
				n := min(len(effects), kvsink.MaxBatch)
				if err := kv.Apply(ctx, effects[:n]...); err != nil {
					return err
				}
				effects = effects[n:]
			}
			return nil
		},
	})
	if err != nil {
		return demoSummary{}, err
	}
	stops.goUntil(func(ctx context.Context) { _ = runner.Run(ctx) })
	d.note("NATS with JetStream up at %s; lease bucket, job stream (%d partitions) and the fenced KV sink ready", url, cfg.partitions)

	// The workers are processes, so that one can really be frozen.
	procs := map[string]*fleet.Proc{}
	for i := range cfg.workers {
		name := fmt.Sprintf("worker-%d", i+1)
		p, err := fleet.Start(name, []string{"worker", "--nats", url, "--partitions", fmt.Sprint(cfg.partitions),
			"--worker-id", name, "--ttl", cfg.ttl.String(), "--work-time", cfg.workTime.String(), "--write-behind",
			"--http", "", "--log-level", "error", "--history", filepath.Join(dir, "history"), "--otlp", cfg.otlp},
			fleet.Options{LogDir: filepath.Join(dir, "logs")})
		if err != nil {
			return demoSummary{}, err
		}
		procs[name] = p
		stops.push(func() { _ = p.Stop(30 * time.Second) })
	}
	d.note("started %d worker processes; they share the partitions through leases", cfg.workers)

	stopProducer := stops.goUntil(func(ctx context.Context) { d.produce(ctx, js, prefix, tel.Config()) })
	stopView := stops.goUntil(func(ctx context.Context) { d.view(ctx, bucket) })

	// The freeze: a quarter into the run, the worker holding the most
	// partitions stops for TTL + 2s.
	deadline := d.start.Add(cfg.duration)
	if sleepCtx(ctx, cfg.duration/4) == nil {
		if err := d.freeze(ctx, bucket, procs, filepath.Join(dir, "history")); err != nil {
			return demoSummary{}, err
		}
	}
	// Run until every job's effect is applied (and the frozen worker's
	// partitions have recovered), or until the duration is up.
	for ctx.Err() == nil && time.Now().Before(deadline) {
		if d.finished() {
			d.note("every job's effect is applied; stopping the workers (SIGTERM: they drain and release)")
			break
		}
		sleepCtx(ctx, 200*time.Millisecond)
	}
	stopProducer()
	for _, p := range procs {
		_ = p.Term()
	}
	for _, p := range procs {
		_ = p.Stop(30 * time.Second)
	}
	// Let the runner apply what the workers flushed while draining.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	for wctx.Err() == nil && !d.allApplied() {
		sleepCtx(wctx, 100*time.Millisecond)
	}
	stopView()
	return d.summary(context.WithoutCancel(ctx), kv, bucket), nil
}

// stack runs cleanup functions in reverse order, once.
type stack struct{ fns []func() }

func (s *stack) push(f func()) { s.fns = append(s.fns, sync.OnceFunc(f)) }

func (s *stack) run() {
	for i := len(s.fns) - 1; i >= 0; i-- {
		s.fns[i]()
	}
}

// goUntil runs f in a goroutine until the returned stop is called (or the
// stack runs), and waits for it to return.
func (s *stack) goUntil(f func(ctx context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f(ctx) }()
	stop = sync.OnceFunc(func() { cancel(); <-done })
	s.push(stop)
	return stop
}

func (d *demo) finished() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.enqueued) == d.cfg.jobs && len(d.applied) >= d.cfg.jobs && (d.pauses == 0 || d.failover > 0)
}

func (d *demo) allApplied() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k := range d.enqueued {
		if !d.applied[k] {
			return false
		}
	}
	return true
}

// noteRecovery records when a partition the frozen worker held first
// applies an effect under a newer epoch. Called with d.mu held.
func (d *demo) noteRecovery(p leasehold.Partition, e leasehold.Epoch) {
	old, ok := d.pausedEpoch[p]
	if !ok || e <= old || !d.recovered[p].IsZero() {
		return
	}
	d.recovered[p] = time.Now()
	if len(d.recovered) == len(d.pausedEpoch) {
		d.failover = time.Since(d.pausedAt)
	}
}
