package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.opentelemetry.io/otel/attribute"
	noopmetric "go.opentelemetry.io/otel/metric/noop"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/chaos"
)

type sinkFlags struct {
	conn         natsFlags
	kind         string
	postgresURL  string
	kvBucket     string
	downstream   string
	atomicJobs   bool
	verifyEpochs bool
	legacyScope  string
	httpAddr     string
	historyDir   string
	name         string
	logLevel     string
	noFence      bool
	otlp         string
	resumeGap    uint64
	http         httpFlags
	tel          telemetry.Config // set by runSink
}

func newSinkCmd() *cobra.Command {
	var f sinkFlags
	cmd := &cobra.Command{
		Use:   "sink",
		Short: "Run a sink runner: apply the workers' effects under the fence",
		Long: `sink consumes the effect log (<prefix>-effects, on <prefix>.out.>) in order with a
durable consumer, refuses every effect whose epoch is below its partition's
recorded maximum (barriers raise it at the moment of take-over), and applies the
rest to a KV bucket (--kind kv), a PostgreSQL database (--kind postgres), a
downstream stream (--kind stream) or an HTTP endpoint (--kind http --url URL:
one request per effect, with its Idempotency-Key, sent only while this relay
holds its lock). Refused effects are terminated, counted,
logged and traced. Its progress is crash-safe: a runner killed at any point
resumes with nothing applied twice or lost. Run one runner per effect log.

A runner that finds messages of the log removed before it handled them (by the
log's limits, or by hand) stops at that gap, since one may have been a
take-over's barrier: /readyz fails and leasehold_sink_gap is 1. Restart it with
--resume-gap <position> to go on past the gap on purpose.

Without a subcommand it runs the sink; ` + "`sink ls`" + ` and ` + "`sink get KEY`" + ` read what a KV
sink holds, with the stamp each value was written under.`,
		Args: noArgsSuggest,
		RunE: func(cmd *cobra.Command, _ []string) error { return runSink(cmd.Context(), f) },
	}
	cmd.AddCommand(newSinkLs(), newSinkGet())
	fs := cmd.Flags()
	f.conn.register(fs)
	fs.StringVar(&f.kind, "kind", "kv", "where accepted effects go: kv, postgres, stream or http")
	fs.StringVar(&f.postgresURL, "postgres-url", "", "PostgreSQL connection URL for --kind postgres (env DATABASE_URL too)")
	fs.StringVar(&f.kvBucket, "kv-bucket", "leasehold-sink", "KV bucket for --kind kv")
	fs.StringVar(&f.downstream, "downstream", "", "stream accepted effects are republished into, for --kind stream (default <prefix>-fenced)")
	fs.BoolVar(&f.atomicJobs, "atomic-jobs", false, "for --kind stream: republish each job's effects on a subject in one atomic batch, so that readers see all of them or none (needs a downstream stream that allows atomic publish; slower, on one replica much slower)")
	fs.BoolVar(&f.verifyEpochs, "verify-epochs", true, "check every new epoch against the lease bucket before it may raise a fence, refusing forged epochs (needs read access to the lease bucket; --verify-epochs=false trusts every stamp)")
	fs.StringVar(&f.legacyScope, "legacy-scope", "", "the scope (normally the job stream's prefix) that wrote progress saved before fence scopes: it is converted in place; without it such progress is refused")
	fs.StringVar(&f.httpAddr, "http", ":8081", "address for the status page (/), /metrics, /livez and /readyz ('' to serve nothing)")
	fs.StringVar(&f.historyDir, "history", "", "directory to append this process's decision history to (for the chaos checker)")
	fs.StringVar(&f.name, "name", "sink", "name of this runner in logs, history and its durable consumer")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&f.noFence, "unsafe-no-fence", false, "apply every effect without fencing (--kind kv only): shows what the fence prevents; never use it for real")
	fs.Uint64Var(&f.resumeGap, "resume-gap", 0, "resume past a gap in the effect log up to this log position, on purpose: whatever the log lost there is given up (the runner stops at a gap and its ERROR line names the position); harmless once passed")
	fs.StringVar(&f.otlp, "otlp", "", "OTLP/HTTP endpoint to send traces to, such as http://127.0.0.1:4318 (default $OTEL_EXPORTER_OTLP_ENDPOINT; none: no traces)")
	f.http.register(fs)
	_ = fs.MarkHidden("history")
	_ = fs.MarkHidden("unsafe-no-fence")
	return cmd
}

// applier applies accepted effects to the chosen destination.
type applier struct {
	applyBatch func(ctx context.Context, effects []sink.Effect) error
	ready      telemetry.ReadyFunc
	close      func()
}

func runSink(ctx context.Context, f sinkFlags) error {
	log, err := newLogger(f.logLevel)
	if err != nil {
		return err
	}
	if f.postgresURL == "" {
		f.postgresURL = os.Getenv("DATABASE_URL")
	}
	if f.atomicJobs && f.kind != "stream" {
		return fmt.Errorf("--atomic-jobs is for --kind stream (a downstream stream); --kind %s writes each job as its destination allows", f.kind)
	}
	nc, js, err := f.conn.connect(ctx, "leasehold sink "+f.name)
	if err != nil {
		return err
	}
	defer nc.Close()
	var hist *history.Writer
	if f.historyDir != "" {
		if hist, err = history.Create(f.historyDir, f.name); err != nil {
			return err
		}
		defer hist.Close()
	}
	tel, metrics, shutdown, err := telemetry.Setup(ctx, telemetry.SetupConfig{
		OTLPEndpoint:       f.otlp,
		ResourceAttributes: []attribute.KeyValue{semconv.ServiceInstanceID(f.name)},
		NoGlobals:          true,
	})
	if err != nil {
		return err
	}
	defer flushTelemetry(shutdown, log)
	f.tel = tel.Config()
	if f.noFence {
		if f.kind != "kv" {
			return fmt.Errorf("--unsafe-no-fence works with --kind kv only")
		}
		log.Warn("sink starting WITHOUT FENCING: stale effects will be applied", "name", f.name)
		return runUnfenced(ctx, js, f, hist, log)
	}
	pageCfg := statuspage.ServeConfig{JetStream: js, Prefix: f.conn.prefix, Name: f.name, ServedBy: "sink " + f.name, Addr: f.httpAddr,
		Metrics: metrics, Telemetry: f.tel, DeadLetters: statuspage.DefaultDeadLetters(f.conn.prefix, false, true), Logger: log}
	var verifier *coordinator.Bucket
	if f.verifyEpochs {
		b, err := f.conn.openLeaseBucket(ctx, js)
		if err != nil {
			if _, serr := js.Stream(ctx, "KV_"+f.conn.leaseBucket()); errors.Is(serr, jetstream.ErrStreamNotFound) {
				return fmt.Errorf("run `leasehold init --prefix %s` first: there is no lease bucket %s, which the sink checks every new epoch against%s",
					f.conn.prefix, f.conn.leaseBucket(), f.conn.knownPrefixes(ctx, js))
			}
			return fmt.Errorf("the sink checks every new epoch against the lease bucket (--verify-epochs): %w", err)
		}
		verifier, pageCfg.Bucket = b, b
	}
	page, err := startPage(ctx, pageCfg)
	if err != nil {
		return err
	}
	defer page.Close()
	observers := sink.Observers{page.SinkObserver()}
	var applied sink.Observer
	if hist != nil {
		observers = append(observers, historyDecisions(hist, ""))
		applied = historyDecisions(hist, applyStage)
	}
	cfg := streamsink.Config{
		Prefix:    f.conn.prefix,
		Consumer:  f.conn.prefix + "-" + f.name,
		Name:      f.name,
		Observer:  observers,
		Logger:    log,
		Telemetry: f.tel,
		// Progress saved before fence scopes is converted with this set.
		LegacyScope: f.legacyScope,
	}
	if verifier != nil {
		cfg.Verifier = verifier
	}
	switch f.kind {
	case "http":
		return runHTTPSink(ctx, js, f, cfg, page, log)
	case "stream":
		cfg.Downstream = f.downstream
		cfg.AtomicJobs = f.atomicJobs
	case "kv", "postgres":
		a, err := newApplier(ctx, js, f, applied, log)
		if err != nil {
			return err
		}
		defer a.close()
		cfg.BatchHandler = a.applyBatch
		if a.ready != nil {
			page.Ready(a.ready)
		}
	default:
		return fmt.Errorf("--kind %q: use kv, postgres, stream or http", f.kind)
	}
	r, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		return err
	}
	if f.resumeGap > 0 {
		if err := r.ResumeAfterGap(ctx, f.resumeGap); err != nil {
			return fmt.Errorf("--resume-gap %d: %w", f.resumeGap, err)
		}
	}
	// A gap in the log, or a runner that stopped advancing, fails /readyz.
	page.Ready(r.Ready)
	log.Info("sink starting", "kind", f.kind, "name", f.name, "prefix", f.conn.prefix, "verify_epochs", f.verifyEpochs)
	if err := r.Run(ctx); err != nil && ctx.Err() == nil {
		return fmt.Errorf("sink %s: %w", f.name, err)
	}
	log.Info("sink stopped", "name", f.name, "position", r.Position())
	return nil
}

func newApplier(ctx context.Context, js jetstream.JetStream, f sinkFlags, obs sink.Observer, log *slog.Logger) (*applier, error) {
	switch f.kind {
	case "kv":
		// The sink's fence records must be as durable as the lease
		// bucket's: a lost record admits the writes it refused.
		replicas := 1
		if ls, err := js.Stream(ctx, "KV_"+f.conn.leaseBucket()); err == nil {
			replicas = max(ls.CachedInfo().Config.Replicas, 1)
		} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, fmt.Errorf("look up the lease bucket %s: %w", f.conn.leaseBucket(), err)
		}
		s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: f.kvBucket, Replicas: replicas, MinReplicas: replicas, Name: f.name, Logger: log, Observer: obs, Telemetry: destinationTelemetry(f.tel)})
		if err != nil {
			return nil, err
		}
		// The runner has fenced the effects in log order; the KV sink keys
		// them by idempotency key, so a redelivery is applied once. One
		// Apply per fetched batch: the sink's atomic batch costs about the
		// same for one effect as for hundreds.
		return &applier{
			applyBatch: func(ctx context.Context, effects []sink.Effect) error {
				good := effects[:0:0]
				for _, e := range effects {
					e.Subject = e.Stamp.Key
					if err := kvsink.CheckKey(e.Subject); err != nil {
						// No retry can make the key usable: the runner
						// hands the batch over one effect at a time and
						// moves this one to its dead-letter stream at once.
						// No leasehold worker writes such a key, so it is
						// forged or garbled.
						return fmt.Errorf("%w: effect %q of partition %d, epoch %d: its idempotency key cannot be a KV key: %w", streamsink.ErrPoison, e.Stamp.Key, e.Stamp.Partition, e.Stamp.Epoch, err)
					}
					good = append(good, e)
				}
				for len(good) > 0 {
					n := min(len(good), kvsink.MaxBatch)
					err := s.Apply(ctx, good[:n]...)
					if errors.Is(err, leasehold.ErrStaleEpoch) {
						// Only the runner writes this bucket, in log order, so
						// its fence never runs ahead of the runner's; if
						// something else raised it, apply one by one and let
						// the bucket refuse what it must, rather than retry
						// a batch it will never take.
						err = applyEach(ctx, s, good[:n], log)
					}
					if err != nil {
						return err
					}
					good = good[n:]
				}
				return nil
			},
			close: func() {},
		}, nil
	case "postgres":
		if f.postgresURL == "" {
			return nil, fmt.Errorf("--kind postgres needs --postgres-url or DATABASE_URL (for example postgres://user:pass@host:5432/db)")
		}
		pool, err := pgxpool.New(ctx, f.postgresURL)
		if err != nil {
			return nil, fmt.Errorf("--postgres-url: %w", err)
		}
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := pool.Ping(pctx); err != nil {
			pool.Close()
			return nil, fmt.Errorf("PostgreSQL does not answer: %w (check --postgres-url)", err)
		}
		pcfg := pgsink.Config{DB: pool, Name: f.name, Logger: log, Observer: obs, Telemetry: destinationTelemetry(f.tel)}
		if err := pgsink.CreateSchema(pctx, pool, pcfg); err != nil {
			pool.Close()
			return nil, err
		}
		s, err := pgsink.New(pcfg)
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &applier{
			// One transaction per fetched batch.
			applyBatch: func(ctx context.Context, effects []sink.Effect) error { return s.Apply(ctx, effects...) },
			ready:      telemetry.PingReady("PostgreSQL", pool),
			close:      pool.Close,
		}, nil
	}
	return nil, fmt.Errorf("--kind %q: use kv, postgres or stream", f.kind)
}

// destinationTelemetry is tel for the sink the runner applies into: its
// spans, and no metrics. The runner counts every effect's decision in
// leasehold_sink_effects_total under the sink's name; the destination
// judges the same effects again under the same name, and counting those
// decisions too counted each effect twice.
func destinationTelemetry(tel telemetry.Config) telemetry.Config {
	tel.MeterProvider = noopmetric.NewMeterProvider()
	return tel
}

// applyStage marks, in the history, the decisions of the destination
// (the KV or PostgreSQL sink) as opposed to the runner's: the chaos
// checker counts how often each key was applied from them.
const applyStage = chaos.ApplyStage

func applyEach(ctx context.Context, s *kvsink.Sink, effects []sink.Effect, log *slog.Logger) error {
	for _, e := range effects {
		err := s.Apply(ctx, e)
		if errors.Is(err, leasehold.ErrStaleEpoch) {
			log.Warn("the KV bucket refused an effect the runner accepted: something else raised its fence", "key", e.Stamp.Key, "err", err)
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// historyDecisions records sink decisions for the chaos checker.
func historyDecisions(w *history.Writer, stage string) sink.Observer {
	return sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		w.Record(history.Event{
			Reason:    stage,
			Kind:      history.Decision,
			Partition: uint32(d.Stamp.Partition),
			Epoch:     uint64(d.Stamp.Epoch),
			Key:       d.Stamp.Key,
			Outcome:   d.Outcome.String(),
			Max:       uint64(d.Max),
			Holder:    d.Holder,
			Position:  d.Position,
		})
	})
}
