// Package chaos runs leasehold as it runs in production — workers and a
// sink runner as separate OS processes of the leasehold binary, against a
// NATS server or a three-node cluster — injects faults into it, records a
// history of everything that happened, and checks that history.
//
// It follows Kafka's transactions system test (a copier under hard and
// clean restarts; afterwards the output equals the input, without
// duplicates) and Jepsen's method (a nemesis injects faults while clients
// work; a checker judges the recorded history, not the logs). The faults:
// SIGSTOP past the lease TTL and SIGCONT (the zombie maker: workers take
// their stamp before a unit of work and publish after it, so a worker
// paused mid-job really writes with its old epoch when it wakes), SIGKILL,
// graceful SIGTERM, a NATS server restart, killing a cluster node, a
// network partition of one worker (as root, with ip and nft; skipped with
// the reason otherwise), forged or garbage messages in the effect log,
// messages pre-empting an effect's message ID, and garbage records in the
// lease bucket.
// A producer enqueues jobs throughout.
//
// Beside the KV sink, a second destination takes the same effects over
// HTTP: two relays (`leasehold sink --kind http`) share one lock and send
// what their runner admits to a receiver in the harness process, behind
// an httpsink.Verifier with its fences and keys in KV buckets (see
// receiver.go). Their faults: a relay paused past its lock's TTL while a
// request of its is on the wire (the receiver holds it until the other
// relay has delivered), relays killed, and the receiver down (503, or
// connections refused).
//
// Every process appends to its own history file; Check merges them with
// the job stream, the effect log and the sink's final contents and reports
// violations of: (a) no stale application, and no admission of an epoch
// and acquisition the lease bucket never issued to the fence, (b) every
// job's effect applied exactly once, (c) per-partition epochs that
// strictly increase, (d) one holder per epoch, (e) liveness: no partition
// stalls (pending jobs, a live holder, no progress) for longer than the
// TTL + 5s, and no job is left unapplied; and (f) at the HTTP receiver,
// every job's effect handled once after the Verifier's dedupe, none lost,
// none of a zombie, of an attempt that did not complete, or sent by a
// relay that a newer one had superseded (the CheckHTTP* checks). Forged
// copies of a live holder's exact stamp that the sink applied are counted
// apart: a credential that may publish effects can always write those.
// Run returns the figures `leasehold chaos` prints.
//
// Children run Config.Binary, the leasehold command. The leasehold command
// and its tests run themselves; other callers build the command first
// (go build github.com/leasehold/leasehold/cmd/leasehold) and pass its path.
package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/worker"
)

// Config configures a run.
type Config struct {
	// Duration is how long faults are injected. Default 60s. The run takes
	// longer: start-up, then the wait for the sink to catch up.
	Duration time.Duration
	// Cluster runs a three-node cluster with every stream and bucket at
	// three replicas, instead of one server.
	Cluster bool
	// Workers is the number of worker processes. Default 3. They write
	// behind (they take their stamp before the work and publish after
	// it), which turns a pause into a zombie write. A fourth worker runs in
	// a network namespace when partitions are possible; it emits through
	// the SDK's Job.Emit.
	Workers int
	// Partitions of the job stream. Default 8.
	Partitions int
	// TTL is the lease TTL, whole seconds. Default 2s.
	TTL time.Duration
	// PartitionConcurrency is how many jobs of one partition each worker
	// runs at once (`leasehold worker --partition-concurrency`), in order
	// per key. Default 8: jobs complete out of stream order within a lease,
	// so the checks cover the worker's watermark and done set, the finals'
	// floors and the sink's applied sets. 1 runs one job of a partition at
	// a time.
	PartitionConcurrency int
	// WorkTime is what each job takes, between taking its stamp and
	// publishing its effect. Default 50ms.
	WorkTime time.Duration
	// Rate is the jobs enqueued per second. Default 25.
	Rate int
	// FaultGap is the mean quiet time between two faults. Default 2s.
	FaultGap time.Duration
	// Faults lists the fault types to inject (Fault* constants). Default:
	// every type that applies (node kills in a cluster, a server restart
	// on a single server, partitions when possible).
	Faults []string
	// Unfenced runs the sink with fencing switched off (`leasehold sink
	// --unsafe-no-fence`): it applies every effect it reads. It exists to
	// show that the checker catches what fencing prevents.
	Unfenced bool
	// HTTPUnverified runs the HTTP receiver without its Verifier: every
	// request reaches its handler. It exists to show that the checker
	// catches what the Verifier prevents (a superseded relay's requests,
	// repeats of a key).
	HTTPUnverified bool
	// Settle bounds the wait, after the faults, for every job's effect to
	// reach the sink and the HTTP receiver. Default 2 minutes.
	Settle time.Duration
	// Dir holds the servers' stores, the histories and the process logs.
	// Default: a temporary directory, removed after a run without
	// violations unless Keep is set.
	Dir  string
	Keep bool
	// Binary is the leasehold executable the processes run. Default: this
	// process's own executable (the leasehold command, or a test binary
	// that runs it; see the package doc).
	Binary string
	// Seed seeds the fault schedule. Default: random.
	Seed uint64
	// Logger receives the harness's progress. Default: discard.
	Logger *slog.Logger
}

const (
	prefix     = "chaos"
	leaseKV    = "chaos-leases"
	sinkKV     = "chaos-sink"
	sinkName   = "sink"
	effectProc = "effect-log" // the target named in injection records
)

func (c *Config) setDefaults() {
	if c.Duration == 0 {
		c.Duration = 60 * time.Second
	}
	if c.Workers == 0 {
		c.Workers = 3
	}
	if c.Partitions == 0 {
		c.Partitions = 8
	}
	if c.TTL == 0 {
		c.TTL = 2 * time.Second
	}
	if c.PartitionConcurrency == 0 {
		c.PartitionConcurrency = 8
	}
	if c.WorkTime == 0 {
		c.WorkTime = 50 * time.Millisecond
	}
	if c.Rate == 0 {
		c.Rate = 25
	}
	if c.FaultGap == 0 {
		c.FaultGap = 2 * time.Second
	}
	if c.Settle == 0 {
		c.Settle = 2 * time.Minute
	}
	if c.Seed == 0 {
		c.Seed = rand.Uint64()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

// Validate reports every problem with c.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if c.Duration < 0 || c.Settle < 0 || c.WorkTime < 0 || c.FaultGap < 0 {
		errs = append(errs, errors.New("durations must not be negative"))
	}
	if c.PartitionConcurrency < 0 || c.PartitionConcurrency > worker.MaxPartitionConcurrency {
		errs = append(errs, fmt.Errorf("partition concurrency %d: use 1 to %d (0: the default, 8)", c.PartitionConcurrency, worker.MaxPartitionConcurrency))
	}
	if c.Workers < 2 {
		errs = append(errs, fmt.Errorf("workers %d: use at least 2, so that partitions have somewhere to fail over to", c.Workers))
	}
	if c.Partitions < 1 || c.Partitions > 1024 {
		errs = append(errs, fmt.Errorf("partitions %d: use 1 to 1024", c.Partitions))
	}
	if c.TTL < time.Second || c.TTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("TTL %v: use whole seconds, at least 1s", c.TTL))
	}
	if c.Rate < 1 || c.Rate > 5000 {
		errs = append(errs, fmt.Errorf("rate %d: use 1 to 5000 jobs a second", c.Rate))
	}
	for _, f := range c.Faults {
		if !faultKinds[f] {
			errs = append(errs, fmt.Errorf("fault %q: use one of %s", f, strings.Join(FaultNames(), ", ")))
		}
	}
	return errors.Join(errs...)
}

// Result is what a run found.
type Result struct {
	*Analysis
	// Dir holds the run's histories (history/), process logs (logs/) and
	// server stores; it is removed after a clean run unless Config.Keep.
	Dir string
	// Seed reproduces the fault schedule.
	Seed uint64
	// Elapsed is the whole run's time.
	Elapsed time.Duration
	// Skipped says which faults could not be injected here, and why.
	Skipped []string
	// Settled is false when some job's effect had not reached the sink
	// when Config.Settle ran out.
	Settled bool
}

// harness is one run.
type harness struct {
	cfg     Config
	bin     string
	dir     string
	histDir string
	logDir  string
	log     *slog.Logger
	rnd     *rand.Rand

	srv    *servers
	nc     *nats.Conn
	js     jetstream.JetStream
	bucket *coordinator.Bucket
	nemo   *history.Writer // the harness's own records
	net    *netPartition
	forger *forger // nil unless FaultForgedMarker is injected

	mu      sync.Mutex
	workers []*proc
	sink    *proc
	relays  []*proc
	recv    *receiver
	skipped []string
	faults  []string
	pending []string // faults still to inject once each; nil before the first pick

	// enqueued is signalled (without blocking) each time the producer's
	// enqueue is acknowledged: a restarted server has served one when it
	// fires after the restart.
	enqueued chan struct{}
}

// Run runs the workload under faults for cfg.Duration, waits for the sink
// to catch up, stops everything, and checks the history. An error means
// the run itself could not be carried out; violations are in the result.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("chaos: invalid config: %w", err)
	}
	cfg.setDefaults()
	start := time.Now()
	h := &harness{cfg: cfg, log: cfg.Logger, rnd: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)), enqueued: make(chan struct{}, 1)}
	h.bin = cfg.Binary
	if h.bin == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("chaos: find the leasehold executable: %w (set Config.Binary)", err)
		}
		h.bin = exe
	}
	h.dir = cfg.Dir
	if h.dir != "" {
		// A history appended to another run's would be judged as one.
		if entries, err := os.ReadDir(h.dir); err == nil && len(entries) > 0 {
			return nil, fmt.Errorf("chaos: directory %s is not empty: give each run a new one", h.dir)
		}
	}
	if h.dir == "" {
		d, err := os.MkdirTemp("", "leasehold-chaos-")
		if err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		h.dir = d
	}
	h.histDir, h.logDir = filepath.Join(h.dir, "history"), filepath.Join(h.dir, "logs")
	res, err := h.run(ctx)
	if err != nil {
		err = fmt.Errorf("%w (stores, histories and logs in %s)", err, h.dir)
	}
	if res != nil {
		res.Elapsed = time.Since(start)
		if cfg.Dir == "" && !cfg.Keep && err == nil && res.OK() {
			os.RemoveAll(h.dir)
		}
	}
	return res, err
}

func (h *harness) run(ctx context.Context) (*Result, error) {
	var err error
	if h.nemo, err = history.Create(h.histDir, "harness"); err != nil {
		return nil, err
	}
	defer h.nemo.Close()
	if h.srv, err = startServers(h.dir, h.cfg.Cluster); err != nil {
		return nil, err
	}
	defer h.srv.shutdown()
	h.nc, err = nats.Connect(h.srv.urls(), nats.Name("leasehold chaos harness"), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond), nats.Timeout(2*time.Second))
	if err != nil {
		return nil, fmt.Errorf("chaos: connect: %w", err)
	}
	defer h.nc.Close()
	if h.js, err = jetstream.New(h.nc); err != nil {
		return nil, err
	}
	if err := h.provision(ctx); err != nil {
		return nil, err
	}
	h.planFaults()
	if h.wants(FaultPartition) {
		if h.net, err = setupNetPartition(h.srv.addrs()); err != nil {
			h.skip(FaultPartition, err)
		} else {
			defer func() {
				if err := h.net.close(); err != nil {
					h.log.Error("chaos: network namespace not fully removed", "err", err)
				}
			}()
		}
	}
	replicas := 1
	if h.cfg.Cluster {
		replicas = 3
	}
	if h.recv, err = startReceiver(ctx, h.js, h.bucket, replicas, h.cfg.HTTPUnverified, h.log); err != nil {
		return nil, err
	}
	defer h.recv.close()
	defer h.stopAll()
	if err := h.startProcesses(); err != nil {
		return nil, err
	}
	if err := h.warmUp(ctx); err != nil {
		return nil, err
	}
	h.log.Info("chaos: every partition held; faults begin")

	if h.wants(FaultForgedMarker) {
		if h.forger, err = h.startForger(ctx); err != nil {
			return nil, err
		}
		defer h.forger.close()
	}
	prodCtx, stopProducer := context.WithCancel(ctx)
	prodDone := make(chan error, 1)
	go func() { prodDone <- h.produce(prodCtx) }()
	nemErr := h.nemesis(ctx, time.Now().Add(h.cfg.Duration))
	h.forger.close()
	stopProducer()
	if err := <-prodDone; err != nil {
		return nil, err
	}
	if nemErr != nil {
		return nil, nemErr
	}
	if err := h.healAll(ctx); err != nil {
		return nil, err
	}
	h.log.Info("chaos: faults over, every process and server up again")
	settled, err := h.settle(ctx)
	if err != nil {
		return nil, err
	}
	end := time.Now()
	h.log.Info("chaos: settled; stopping the processes", "settled", settled)
	h.stopAll()
	h.log.Info("chaos: processes stopped; reading the history and the streams")
	in, err := h.collect(ctx)
	if err != nil {
		return nil, err
	}
	in.End, in.LivenessBound = end, h.cfg.TTL+5*time.Second
	a := Check(in)
	h.mu.Lock()
	skipped := append([]string(nil), h.skipped...)
	h.mu.Unlock()
	return &Result{Analysis: a, Dir: h.dir, Seed: h.cfg.Seed, Skipped: skipped, Settled: settled}, nil
}

// provision creates the lease bucket, the streams and the sink's buckets,
// with three replicas in a cluster.
func (h *harness) provision(ctx context.Context) error {
	replicas := 1
	if h.cfg.Cluster {
		replicas = 3
	}
	pctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	var err error
	for {
		actx, acancel := context.WithTimeout(pctx, 2*time.Second)
		_, err = h.js.AccountInfo(actx)
		acancel()
		if err == nil || pctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("chaos: JetStream not ready: %w", err)
	}
	if h.bucket, err = coordinator.Provision(pctx, h.js, coordinator.BucketConfig{Bucket: leaseKV, Replicas: replicas, MarkerTTL: 10 * time.Second}); err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	if err := worker.ProvisionJobs(pctx, h.js, worker.JobsConfig{Prefix: prefix, Partitions: h.cfg.Partitions, Replicas: replicas}); err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	for _, b := range []string{sinkKV, prefix + "-" + "sink-state"} {
		err := retry.Do(pctx, func(ctx context.Context) error {
			_, err := h.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.FileStorage, Replicas: replicas})
			return err
		})
		if err != nil {
			return fmt.Errorf("chaos: create bucket %s: %w", b, err)
		}
	}
	return nil
}

// warmUp waits until every partition has a holder.
func (h *harness) warmUp(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		st, err := h.bucket.Snapshot(wctx)
		if err == nil {
			held := 0
			for _, p := range st.Partitions {
				if p.Holder != "" {
					held++
				}
			}
			if held == h.cfg.Partitions {
				break
			}
		}
		select {
		case <-wctx.Done():
			return fmt.Errorf("chaos: the workers did not take every partition within a minute; see the logs in %s", h.logDir)
		case <-time.After(100 * time.Millisecond):
		}
	}
	// Let barriers reach the effect log before forged writes can.
	return sleepCtx(ctx, time.Second)
}

// produce enqueues jobs at the configured rate until ctx ends, recording
// each acknowledged one. An enqueue that fails may still have been stored;
// the job stream, read at the end, says.
func (h *harness) produce(ctx context.Context) error {
	hist, err := history.Create(h.histDir, "producer")
	if err != nil {
		return err
	}
	defer hist.Close()
	p, err := worker.NewProducer(h.js, worker.ProducerConfig{Prefix: prefix, Partitions: h.cfg.Partitions, Retries: 20, RetryWait: 100 * time.Millisecond})
	if err != nil {
		return err
	}
	tick := time.NewTicker(time.Second / time.Duration(h.cfg.Rate))
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		id := fmt.Sprintf("job-%d", i)
		part := leasehold.Partition(i % h.cfg.Partitions)
		opts := []worker.EnqueueOption{worker.JobID(id)}
		if i%10 != 9 {
			// Three order keys a partition, their jobs interleaved, so
			// that a partition runs jobs side by side; one job in ten
			// has no order key, as an earlier release's producer sends
			// it, and runs in partition order.
			opts = append(opts, worker.WithOrderKey(fmt.Appendf(nil, "key-%d", i%(3*h.cfg.Partitions))))
		}
		e, err := p.EnqueueTo(ctx, part, []byte(fmt.Sprintf(`{"n":%d}`, i)), opts...)
		if err != nil {
			if ctx.Err() == nil {
				h.log.Warn("chaos: enqueue failed; the job stream will say whether it was stored", "job", id, "err", err)
			}
			continue
		}
		hist.Record(history.Event{Kind: history.Enqueue, Partition: uint32(e.Partition), Seq: e.Seq, JobID: id})
		select {
		case h.enqueued <- struct{}{}:
		default:
		}
	}
}

// retryUntil runs f until it succeeds or ctx ends: a cluster that has just
// had a node back may not answer every request at once.
func retryUntil(ctx context.Context, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		if serr := sleepCtx(ctx, time.Second); serr != nil {
			return fmt.Errorf("%w (gave up: %v)", err, serr)
		}
	}
}

// record writes one of the harness's own events.
func (h *harness) record(e history.Event) {
	e.Kind = history.Fault
	h.nemo.Record(e)
}

func (h *harness) skip(fault string, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.skipped = append(h.skipped, fault+": "+err.Error())
	h.log.Warn("chaos: fault skipped", "fault", fault, "reason", err)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
