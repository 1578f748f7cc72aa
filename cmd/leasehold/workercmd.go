package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

type workerFlags struct {
	conn         natsFlags
	partitions   int
	id           string
	ttl          time.Duration
	drainTimeout time.Duration
	concurrency  int
	partConc     int
	order        string
	httpAddr     string
	workTime     time.Duration
	writeBehind  bool
	failFirst    int
	historyDir   string
	pidFile      string
	logLevel     string
	otlp         string
	stallAfter   time.Duration
	handleTO     time.Duration
	pprofAddr    string
	labels       bool
	stampFormat  string
	packEffects  bool
}

func newWorkerCmd() *cobra.Command {
	var f workerFlags
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a worker with the example handler against a NATS server",
		Long: `worker joins the worker group in the lease bucket, takes its share of the job
stream's partitions and runs the example handler on each job: it emits one
stamped effect per job to <prefix>.out.<partition>, which ` + "`leasehold sink`" + ` applies.
It serves the status page (/), /metrics, /livez and /readyz on --http; /readyz
fails while NATS is unreachable or a held partition with waiting jobs has
committed nothing for --stall-after (the leasehold_partition_stalled gauge counts
them; with --metric-labels it names each). On SIGTERM or SIGINT (Ctrl-C), alike, it stops taking jobs, finishes
what it has, commits progress and releases its partitions within
--drain-timeout. Run ` + "`leasehold init`" + ` once first.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runWorker(cmd.Context(), f) },
	}
	fs := cmd.Flags()
	f.conn.register(fs)
	fs.IntVar(&f.partitions, "partitions", 0, partitionsHelp)
	fs.StringVar(&f.id, "worker-id", "", "this worker's ID, unique among live workers: a second process under a live ID stops at start (default: the host name and a random suffix, new for each process); in Kubernetes pass the pod name")
	fs.DurationVar(&f.ttl, "ttl", 10*time.Second, "lease TTL: how long a crashed worker's partitions wait before others take them (whole seconds)")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 20*time.Second, "how long a shutdown may take to finish in-flight jobs and release partitions")
	fs.IntVar(&f.concurrency, "concurrency", 100, "handlers this worker runs at once beyond one per held partition: each held partition always runs one job, and every further job running at once takes one of these (0: none, one job per held partition)")
	fs.IntVar(&f.partConc, "partition-concurrency", 16, fmt.Sprintf("jobs of one partition running at once under its lease, in the order --order keeps (1: one at a time, in stream order; at most %d)", worker.MaxPartitionConcurrency))
	fs.StringVar(&f.order, "order", "key", "order among a partition's jobs running at once: key (the jobs of one order key one after another, in stream order; a job without an order key waits for every earlier job), partition (one job of the partition at a time) or none")
	fs.StringVar(&f.stampFormat, "stamp-format", "compact", "the form effects carry their stamp and job mark in: compact (one Leasehold-Stamp and one Leasehold-Mark header) or legacy (one header per field, for sinks of the release before; upgrade sinks first, then switch workers to compact)")
	fs.BoolVar(&f.packEffects, "pack-effects", false, "send the effects a job emits on one subject as one packed message, which a stream sink reads as many at the cost of one (needs --stamp-format compact, and every sink runner reading the effects upgraded to a release that reads packs first)")
	fs.StringVar(&f.httpAddr, "http", ":8080", "address for the status page (/), /metrics, /livez and /readyz ('' to serve nothing)")
	fs.DurationVar(&f.workTime, "work-time", 0, "time the example handler spends on each job")
	fs.BoolVar(&f.writeBehind, "write-behind", false, "example handler takes its stamp before the work and publishes afterwards (makes zombie writes when paused)")
	fs.DurationVar(&f.stallAfter, "stall-after", 2*time.Minute, "how long a held partition with waiting jobs may commit nothing before it counts as stalled (keep it above the longest job)")
	fs.DurationVar(&f.handleTO, "handle-timeout", 5*time.Minute, "bound on one attempt of a job; past it the attempt fails and counts towards the dead-letter stream")
	fs.StringVar(&f.pidFile, "pid-file", "", "file to write this process's ID to while it runs (to signal exactly this worker: kill -STOP $(cat FILE))")
	fs.StringVar(&f.historyDir, "history", "", "directory to append this process's event history to (for the chaos checker)")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&f.labels, "metric-labels", false, "label the metrics of held partitions (lag, epoch, stalled, hung jobs) with the partition and this worker: a series per partition; off: one per process")
	fs.StringVar(&f.otlp, "otlp", "", "OTLP/HTTP endpoint to send traces to, such as http://127.0.0.1:4318 (default $OTEL_EXPORTER_OTLP_ENDPOINT; none: no traces)")
	fs.IntVar(&f.failFirst, "fail-first-attempt", 0, "example handler: one job in N (by its ID) emits two effects and fails its first attempt, then succeeds with one (for the chaos checker)")
	fs.StringVar(&f.pprofAddr, "pprof", "", "address to serve Go's runtime profiles on, under /debug/pprof/ (heap, goroutine, ...), apart from --http ('' to serve none)")
	_ = fs.MarkHidden("fail-first-attempt")
	_ = fs.MarkHidden("history")
	return cmd
}

func runWorker(ctx context.Context, f workerFlags) error {
	log, err := newLogger(f.logLevel)
	if err != nil {
		return err
	}
	order, err := worker.ParseOrder(f.order)
	if err != nil {
		return fmt.Errorf("--order: %w", err)
	}
	stampFormat, err := leasehold.ParseStampFormat(f.stampFormat)
	if err != nil {
		return fmt.Errorf("--stamp-format: %w", err)
	}
	if f.packEffects && stampFormat == leasehold.StampLegacy {
		return fmt.Errorf("--pack-effects with --stamp-format legacy: packed effects carry the compact stamp; upgrade sinks, switch workers to --stamp-format compact, then to --pack-effects")
	}
	if f.partConc < 1 || f.partConc > worker.MaxPartitionConcurrency {
		return fmt.Errorf("--partition-concurrency %d: use 1 to %d", f.partConc, worker.MaxPartitionConcurrency)
	}
	switch {
	case f.concurrency < 0:
		return fmt.Errorf("--concurrency %d: use 0 or more (0: one job per held partition, none beside it)", f.concurrency)
	case f.concurrency == 0:
		// No slots beside each partition's own: one job of a partition at
		// a time, as the flag meant before partitions ran several.
		f.partConc = 1
	}
	if f.id == "" {
		f.id = defaultWorkerID()
	}
	if f.pidFile != "" {
		remove, err := writePidFile(f.pidFile)
		if err != nil {
			return err
		}
		defer remove()
	}
	nc, js, err := f.conn.connect(ctx, "leasehold worker "+f.id)
	if err != nil {
		return err
	}
	defer nc.Close()
	bucket, err := f.conn.openLeaseBucket(ctx, js)
	if err != nil {
		return err
	}
	if f.partitions, err = f.conn.resolvePartitions(ctx, js, f.partitions, 0); err != nil {
		return err
	}
	var hist *history.Writer
	if f.historyDir != "" {
		if hist, err = history.Create(f.historyDir, f.id); err != nil {
			return err
		}
		defer hist.Close()
	}

	tel, metrics, shutdown, err := telemetry.Setup(ctx, telemetry.SetupConfig{
		OTLPEndpoint:       f.otlp,
		ResourceAttributes: []attribute.KeyValue{semconv.ServiceInstanceID(f.id)},
		NoGlobals:          true,
		PartitionLabels:    f.labels,
	})
	if err != nil {
		return err
	}
	defer flushTelemetry(shutdown, log)

	var observer worker.Observer
	if hist != nil {
		observer = historyObserver(hist)
	}
	page, err := startPage(ctx, statuspage.ServeConfig{JetStream: js, Bucket: bucket, Prefix: f.conn.prefix, Name: f.id, ServedBy: "worker " + f.id,
		Addr: f.httpAddr, Metrics: metrics, Telemetry: tel.Config(), Lag: true, DeadLetters: statuspage.DefaultDeadLetters(f.conn.prefix, true, false), Logger: log})
	if err != nil {
		return err
	}
	defer page.Close()
	observer = page.WorkerObserver(observer)
	w, err := worker.New(worker.Config{
		JetStream:  js,
		Prefix:     f.conn.prefix,
		Partitions: f.partitions,
		Bucket:     bucket,
		Handler:    &exampleHandler{js: js, prefix: f.conn.prefix, workTime: f.workTime, writeBehind: f.writeBehind, failFirst: f.failFirst, hist: hist, prop: tel.Config().Propagator},
		Coordinator: coordinator.Config{
			Worker:          f.id,
			TTL:             f.ttl,
			ShutdownTimeout: f.drainTimeout,
			Logger:          log,
		},
		Telemetry:            tel.Config(),
		MaxConcurrency:       f.concurrency,
		PartitionConcurrency: f.partConc,
		Order:                order,
		StampFormat:          stampFormat,
		PackEffects:          f.packEffects,
		StallAfter:           f.stallAfter,
		HandleTimeout:        f.handleTO,
		Logger:               log,
		Observer:             observer,
	})
	if err != nil {
		return err
	}
	page.Ready(w.Ready)
	pprofCtx, stopPprof := context.WithCancel(context.Background())
	waitPprof, err := servePprof(pprofCtx, f.pprofAddr, log)
	if err != nil {
		stopPprof()
		return err
	}
	defer waitPprof()
	defer stopPprof()
	// The worker logs its start and stop itself.
	if err := w.Run(ctx); err != nil {
		return fmt.Errorf("worker %s: %w", f.id, err)
	}
	return nil
}

// servePprof serves the runtime's profiles on addr until ctx ends; with no
// address it does nothing. They stay off the --http mux: a heap or
// goroutine dump shows job data and is for an operator to ask for on an
// address of their choosing.
func servePprof(ctx context.Context, addr string, log *slog.Logger) (wait func(), err error) {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return serve(ctx, "--pprof", addr, "leave it unset", mux, "runtime profiles under /debug/pprof/", log)
}

// writePidFile writes this process's ID to path, and returns what removes
// it again unless another process has written its own meanwhile.
func writePidFile(path string) (remove func(), err error) {
	pid := strconv.Itoa(os.Getpid()) + "\n"
	if err := os.WriteFile(path, []byte(pid), 0o644); err != nil {
		return nil, fmt.Errorf("--pid-file: %w", err)
	}
	return func() {
		if b, err := os.ReadFile(path); err == nil && string(b) == pid {
			_ = os.Remove(path)
		}
	}, nil
}

// flushTelemetry exports the spans not yet sent before the process exits.
func flushTelemetry(shutdown func(context.Context) error, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := shutdown(ctx); err != nil {
		log.Warn("telemetry shutdown", "err", err)
	}
}

func newLogger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}
