package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/worker"
)

// The io rows run jobs whose handler waits 50 ms on a timer (I/O, no CPU)
// and then emits one effect: what such jobs reach is set by how many run at
// once, not by the CPU. leasehold's `leasehold worker` processes run beside
// a hand-written JetStream worker pool (iopool.go) with as many handlers in
// flight and the same acknowledgements, on a job stream of the same shape.
const (
	ioWork = 50 * time.Millisecond
	// ioPartitionConcurrency is how many jobs of one partition run at
	// once, in leasehold and in the pool alike: the worker's default.
	ioPartitionConcurrency = 16
	// ioOrder is the order leasehold keeps among a partition's jobs when
	// more than one runs at once. Every job has a key of its own, so
	// under "key" any two may run side by side.
	ioOrder = "key"
	// ioMaxConcurrency bounds the handlers of one process, as the
	// worker's MaxConcurrency does.
	ioMaxConcurrency = 100
	// ioTTL is the workers' lease TTL: the leases never change hands
	// during a run.
	ioTTL = 10 * time.Second
)

// ioSetup is one configuration of the io rows.
type ioSetup struct {
	partitions, procs    int
	partitionConcurrency int    // jobs of one partition at once
	order                string // leasehold's --order
	maxConcurrency       int    // handlers of one process at most
}

func newIOSetup(partitions, procs int) ioSetup {
	return ioSetup{partitions: partitions, procs: procs, partitionConcurrency: ioPartitionConcurrency, order: ioOrder, maxConcurrency: ioMaxConcurrency}
}

func (s ioSetup) name() string { return fmt.Sprintf("io_p%d_w%d", s.partitions, s.procs) }

// held is the partitions each process holds: the configurations divide
// evenly.
func (s ioSetup) held() int { return s.partitions / s.procs }

// inFlightPerProc is how many handlers one process runs at once while
// every partition it holds has jobs waiting, as worker.Config.MaxConcurrency
// says: each held partition runs one on a slot of its own, and up to
// partitionConcurrency − 1 more on slots of the process's pool of
// maxConcurrency.
func (s ioSetup) inFlightPerProc() int {
	h := s.held()
	return h + min(h*(s.partitionConcurrency-1), s.maxConcurrency)
}

func (s ioSetup) inFlight() int { return s.procs * s.inFlightPerProc() }

// workerArgs are the arguments every `leasehold worker` process of the
// configuration gets besides its group's.
func (s ioSetup) workerArgs() []string {
	args := []string{"--work-time", ioWork.String(), "--concurrency", strconv.Itoa(s.maxConcurrency)}
	if s.partitionConcurrency != 1 {
		args = append(args, "--partition-concurrency", strconv.Itoa(s.partitionConcurrency), "--order", s.order)
	}
	return args
}

// jobs is how many jobs one run enqueues: enough for the run to last
// about 3 s at the rate its handlers in flight allow (0.5 s with Quick),
// and at least 400.
func (s ioSetup) jobs(quick bool) int {
	perSec := float64(s.inFlight()) / ioWork.Seconds()
	if quick {
		return roundUp(max(int(perSec/2), 2*s.inFlight()), s.partitions)
	}
	return roundUp(max(int(3*perSec), 400), s.partitions)
}

func roundUp(n, m int) int { return (n + m - 1) / m * m }

// ioResult is one run of one side.
type ioResult struct {
	jobsPerSec float64
	cpuPerJob  float64 // µs of the worker processes' CPU per job
	rssPerJob  float64 // KiB of RssAnon the processes grew by, per handler in flight
}

// ioSide is a running fleet, leasehold's or the pool's, ready for jobs.
type ioSide interface {
	producer() *worker.Producer
	pids() []int
	// expect notes the jobs a run enqueued; done reports when every job
	// noted so far is finished, and kick is signalled when that may have
	// changed.
	expect(enq []worker.Enqueued)
	done() bool
	kick() <-chan struct{}
	close(ctx context.Context)
}

// ioRows measures every io configuration: per configuration both fleets
// are started once, then run in turn, the order alternating.
func (e *env) ioRows(ctx context.Context) ([]Row, error) {
	setups := []ioSetup{}
	for _, p := range []int{4, 16} {
		for _, w := range []int{1, 2, 4} {
			setups = append(setups, newIOSetup(p, w))
		}
	}
	if e.cfg.Quick {
		setups = []ioSetup{newIOSetup(4, 1), newIOSetup(16, 2)}
	}
	runs := e.cfg.Runs
	if e.cfg.runsDefaulted && !e.cfg.Quick {
		runs = 3
	}
	var rows []Row
	for _, s := range setups {
		r, err := e.ioSetupRows(ctx, s, runs)
		rows = append(rows, r...)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", s.name(), err)
		}
	}
	return rows, nil
}

func (e *env) ioSetupRows(ctx context.Context, s ioSetup, runs int) ([]Row, error) {
	lh, err := e.startIOLeasehold(ctx, s)
	if err != nil {
		return nil, fmt.Errorf("start leasehold's workers: %w", err)
	}
	defer lh.close(ctx)
	pool, err := e.startIOPool(ctx, s)
	if err != nil {
		return nil, fmt.Errorf("start the pool: %w", err)
	}
	defer pool.close(ctx)
	n := s.jobs(e.cfg.Quick)
	keys := ioKeys(s.partitions, n)
	// Memory grows from what each fleet holds idle, once its partitions
	// are held and its consumers waiting.
	lhIdle, poolIdle := anonKiB(lh.pids()), anonKiB(pool.pids())
	var v, b [3][]float64
	for i := range runs {
		order := []bool{false, true} // the pool first on odd runs
		if i%2 == 1 {
			order = []bool{true, false}
		}
		for _, isPool := range order {
			side, idle, out := ioSide(lh), lhIdle, &v
			if isPool {
				side, idle, out = pool, poolIdle, &b
			}
			r, err := e.ioRun(ctx, side, keys, idle, s.inFlight())
			if err != nil {
				what := "leasehold"
				if isPool {
					what = "pool"
				}
				return nil, fmt.Errorf("%s run %d: %w", what, i+1, err)
			}
			out[0], out[1], out[2] = append(out[0], r.jobsPerSec), append(out[1], r.cpuPerJob), append(out[2], r.rssPerJob)
		}
		e.progress("%s run %d (%d jobs, %d in flight): leasehold %.0f jobs/s %.0f µs CPU/job, pool %.0f jobs/s %.0f µs CPU/job",
			s.name(), i+1, n, s.inFlight(), v[0][i], v[1][i], b[0][i], b[1][i])
	}
	what := fmt.Sprintf("%d jobs a run whose handler waits %v on a timer and emits one effect, %d partitions, %d worker processes, %d handlers in flight (%d a partition, at most %d a process)",
		n, ioWork, s.partitions, s.procs, s.inFlight(), s.partitionConcurrency, s.maxConcurrency)
	base := fmt.Sprintf("a hand-written JetStream pool in as many processes: a durable pull consumer per partition fetched %d at a time into a queue, %d handlers a process taking jobs from it in any order, each acking its job after its effect's PubAck", poolFetch, s.inFlightPerProc())
	return []Row{
		paired(s.name(), "jobs/s", v[0], b[0], fmt.Sprintf("%s: from the first enqueue until every job is committed (leasehold: progress in the fence records) or acked (pool); the ceiling is %.0f jobs/s; baseline: %s", what, float64(s.inFlight())/ioWork.Seconds(), base)),
		paired(s.name()+"_cpu", "µs CPU/job", v[1], b[1], "CPU time (user and system, from /proc) of the worker processes per job in the runs above, the server's not counted; baseline: the pool's processes"),
		paired(s.name()+"_rss", "KiB/in-flight", v[2], b[2], "growth of the worker processes' RssAnon from idle (partitions held, consumers waiting) to the peak of a run, summed, per handler in flight; jobs fetched ahead of their handler count too; baseline: the pool's processes"),
	}, nil
}

// ioRun enqueues the jobs keys name on side, one each, and waits until
// every one is finished.
func (e *env) ioRun(ctx context.Context, side ioSide, keys [][]byte, idleKiB float64, inFlight int) (ioResult, error) {
	var res ioResult
	pids := side.pids()
	cpu0, err := procsCPU(pids)
	if err != nil {
		return res, err
	}
	peak := sampleAnon(ctx, pids)
	data := make([]byte, 64)
	t0 := time.Now()
	b := side.producer().Batch()
	var enq []worker.Enqueued
	for i, k := range keys {
		if err := b.Enqueue(ctx, k, data); err != nil {
			peak()
			return res, err
		}
		if (i+1)%1000 == 0 || i == len(keys)-1 {
			got, err := b.Wait(ctx)
			if err != nil {
				peak()
				return res, err
			}
			enq = append(enq, got...)
		}
	}
	side.expect(enq)
	err = waitDone(ctx, side, time.Minute)
	took := time.Since(t0)
	top := peak()
	if err != nil {
		return res, err
	}
	cpu1, err := procsCPU(pids)
	if err != nil {
		return res, err
	}
	res.jobsPerSec = float64(len(keys)) / took.Seconds()
	res.cpuPerJob = (cpu1 - cpu0).Seconds() * 1e6 / float64(len(keys))
	res.rssPerJob = max(top-idleKiB, 0) / float64(inFlight)
	return res, nil
}

// waitDone waits until side has finished every job it expects, or until
// it has finished none for quiet.
func waitDone(ctx context.Context, side ioSide, quiet time.Duration) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	since := time.Now()
	for !side.done() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-side.kick():
			since = time.Now()
		case <-tick.C:
			if time.Since(since) > quiet {
				return fmt.Errorf("no job finished for %v", quiet)
			}
		}
	}
	return nil
}

// ioKeys returns n job keys, each its own, that spread evenly over the
// partitions by leasehold's partitioner: job i lands on partition i mod
// partitions.
func ioKeys(partitions, n int) [][]byte {
	per := make([][][]byte, partitions)
	for c := 0; ; c++ {
		k := []byte("job-" + strconv.Itoa(c))
		p := leasehold.PartitionFor(k, partitions)
		if len(per[p]) < n/partitions {
			per[p] = append(per[p], k)
		}
		full := true
		for _, ks := range per {
			full = full && len(ks) == n/partitions
		}
		if full {
			break
		}
	}
	keys := make([][]byte, 0, n)
	for i := range n / partitions {
		for p := range partitions {
			keys = append(keys, per[p][i])
		}
	}
	return keys
}

// ioLeasehold is `leasehold worker` processes with the example handler
// (--work-time), and a watch of the fence records, where committed
// progress is.
type ioLeasehold struct {
	g    *procGroup
	prod *worker.Producer
	stop func()
	k    chan struct{}

	mu        sync.Mutex
	committed map[leasehold.Partition]uint64
	want      map[leasehold.Partition]uint64
}

func (e *env) startIOLeasehold(ctx context.Context, s ioSetup) (*ioLeasehold, error) {
	prefix := fmt.Sprintf("iolh%d-%d", s.partitions, s.procs)
	g, err := e.newProcGroup(ctx, prefix, s.partitions, ioTTL)
	if err != nil {
		return nil, err
	}
	l := &ioLeasehold{g: g, k: make(chan struct{}, 1), committed: map[leasehold.Partition]uint64{}, want: map[leasehold.Partition]uint64{}}
	ok := false
	defer func() {
		if !ok {
			l.close(ctx)
		}
	}()
	g.args = s.workerArgs()
	if l.prod, err = worker.NewProducer(g.js, worker.ProducerConfig{Prefix: prefix, Partitions: s.partitions}); err != nil {
		return nil, err
	}
	b, err := coordinator.OpenBucket(ctx, g.js, g.bucket)
	if err != nil {
		return nil, err
	}
	w, err := b.FenceRecords().Watch(ctx, "partition.>")
	if err != nil {
		return nil, fmt.Errorf("watch the fence records: %w", err)
	}
	l.stop = e.goRun(ctx, func(ctx context.Context) {
		defer func() {
			_ = w.Stop()
			for range w.Updates() {
			}
		}()
		for {
			select {
			case <-ctx.Done():
				return
			case en, open := <-w.Updates():
				if !open {
					return
				}
				if en != nil {
					l.onFence(en)
				}
			}
		}
	}, nil)
	ids := make([]string, s.procs)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-w%d", prefix, i)
		if err := g.start(ids[i]); err != nil {
			return nil, err
		}
	}
	if err := wait(ctx, 2*time.Minute, "every worker holds its share", func() bool { return g.balanced(ids, false) }); err != nil {
		return nil, fmt.Errorf("%w (%s)", err, g.summary())
	}
	ok = true
	return l, nil
}

// onFence notes a partition's committed progress: the fence record's
// last input sequence committed.
func (l *ioLeasehold) onFence(en jetstream.KeyValueEntry) {
	p, err := leasehold.ParsePartition(strings.TrimPrefix(en.Key(), "partition."))
	if err != nil || en.Operation() != jetstream.KeyValuePut {
		return
	}
	var r struct {
		Seq uint64 `json:"seq"`
	}
	if json.Unmarshal(en.Value(), &r) != nil {
		return
	}
	l.mu.Lock()
	l.committed[p] = max(l.committed[p], r.Seq)
	l.mu.Unlock()
	select {
	case l.k <- struct{}{}:
	default:
	}
}

func (l *ioLeasehold) producer() *worker.Producer { return l.prod }
func (l *ioLeasehold) kick() <-chan struct{}      { return l.k }

func (l *ioLeasehold) pids() []int {
	var out []int
	for _, id := range l.g.running() {
		if p := l.g.proc(id); p != nil {
			out = append(out, p.Pid())
		}
	}
	return out
}

func (l *ioLeasehold) expect(enq []worker.Enqueued) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range enq {
		l.want[e.Partition] = max(l.want[e.Partition], e.Seq)
	}
}

func (l *ioLeasehold) done() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for p, seq := range l.want {
		if l.committed[p] < seq {
			return false
		}
	}
	return true
}

func (l *ioLeasehold) close(ctx context.Context) {
	if l.stop != nil {
		l.stop()
	}
	l.g.close(ctx)
}

// procsCPU is the CPU time, user and system, the processes have used.
func procsCPU(pids []int) (time.Duration, error) {
	var total time.Duration
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, err
		}
		// The fields after the command name, which is in parentheses and
		// may hold spaces: state is the first, utime the 12th, stime the
		// 13th, in clock ticks (USER_HZ, 100 on Linux).
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) < 13 {
			return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
		}
		for _, v := range f[11:13] {
			t, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
			}
			total += time.Duration(t) * 10 * time.Millisecond
		}
	}
	return total, nil
}

// anonKiB is the processes' RssAnon, summed, in KiB.
func anonKiB(pids []int) float64 {
	var total float64
	for _, pid := range pids {
		mib, err := statusMiB(pid, "RssAnon")
		if err == nil {
			total += mib * 1024
		}
	}
	return total
}

// sampleAnon samples the processes' summed RssAnon every 20 ms until the
// returned function is called, which returns the highest sample.
func sampleAnon(ctx context.Context, pids []int) func() float64 {
	ctx, cancel := context.WithCancel(ctx)
	out := make(chan float64, 1)
	go func() {
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		top := anonKiB(pids)
		for {
			select {
			case <-ctx.Done():
				out <- max(top, anonKiB(pids))
				return
			case <-t.C:
				top = max(top, anonKiB(pids))
			}
		}
	}()
	return func() float64 {
		cancel()
		return <-out
	}
}

// startIOPoolProc starts one process of the pool: the leasehold binary's
// hidden `bench --io-pool-worker` mode (see RunPoolWorker).
func (e *env) startIOPoolProc(id string, spec poolSpec) (*fleet.Proc, error) {
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	return fleet.Start(id, []string{"bench", "--io-pool-worker", string(b)}, e.fleetOptions())
}
