package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/retry"
)

// floorBatch is the partitions per atomic batch of the batched write
// floor.
const floorBatch = 100

// scaleResult is one scale run.
type scaleResult struct {
	joined          float64 // seconds from the first start until every member registered
	owned, balanced float64 // seconds from the first start
	opsPerSec       float64 // lease bucket writes per second, idle
	memMiB          float64 // per worker: RSS of processes, or heap growth in this process
	anonMiB         float64 // per worker process: RssAnon, its own memory without file pages
}

// scale starts many group members at once on thousands of partitions and
// measures how long until every partition is held, and until every member
// holds its share; then, with the group idle, the lease bucket's write
// rate (member renewals: partition records are written only to acquire
// and release) and the memory per member. The lease layer is measured
// as coordinator.Run members in this process, each on its own connection;
// full `leasehold worker` processes, which also read every partition they
// hold through a consumer of their own, are tried once with a bound, and
// reported as not converging when they do not.
func (e *env) scale(ctx context.Context) ([]Row, error) {
	partitions, workers, runs, ttl := 4096, 32, min(e.cfg.Runs, 3), 10*time.Second
	procParts, procWorkers := 4096, 32
	if e.cfg.Quick {
		partitions, workers, runs, ttl = 256, 4, 1, 3*time.Second
		procParts, procWorkers = 64, 4
	}
	// Leases renew every TTL/3 from when they were taken: a window of one
	// TTL sees every lease renew three times, whatever the phase.
	window := ttl
	var owned, balanced, ops, mem []float64
	for run := range runs {
		r, err := e.scaleRun(ctx, fmt.Sprintf("sc%d", run), partitions, workers, ttl, window, asLeases, 2*time.Minute)
		if err != nil {
			return nil, err
		}
		owned, balanced, ops, mem = append(owned, r.owned), append(balanced, r.balanced), append(ops, r.opsPerSec), append(mem, r.memMiB)
		e.progress("scale run %d: %d partitions over %d lease-layer members: all registered after %.3f s, all held after %.3f s, balanced after %.3f s; %.0f lease writes/s idle; heap %.2f MiB per member",
			run+1, partitions, workers, r.joined, r.owned, r.balanced, r.opsPerSec, r.memMiB)
	}
	what := fmt.Sprintf("%d partitions, %d %v started together, TTL %v", partitions, workers, asLeases, ttl)
	rows := []Row{
		single("scale_owned", "s", owned, what+": from the first start until every partition is held; target <= 5 s"),
		single("scale_balanced", "s", balanced, what+": until every member holds its share"),
		single("scale_renew_load", "KV ops/s", ops, what+fmt.Sprintf(": lease bucket writes per second once balanced and idle, over %v (each member renews its registration every TTL/3, which keeps its partitions; target <= 100); every member's watch receives each of them", window)),
		single("scale_heap_per_member", "MiB", mem, what+": growth of this process's Go heap in use (after GC) per member once balanced, the server's share included"),
	}

	// The most partitions the API allows, over many lease-layer members:
	// how fast acquisitions go, and that the idle load stays with the
	// members.
	bigParts, bigWorkers, bigRuns := 65536, 64, min(e.cfg.Runs, 2)
	if e.cfg.Quick {
		bigParts, bigWorkers, bigRuns = 4096, 8, 1
	}
	var bigOwned, bigBalanced, bigOps []float64
	bwhat := fmt.Sprintf("%d partitions, %d %v started together, TTL %v", bigParts, bigWorkers, asLeases, ttl)
	for run := range bigRuns {
		bigBound := time.Minute
		r, err := e.scaleRun(ctx, fmt.Sprintf("sl%d", run), bigParts, bigWorkers, ttl, window, asLeases, bigBound)
		if err != nil {
			e.progress("scale with %d partitions: %v", bigParts, err)
			rows = append(rows, Row{Name: "scale_max_balanced", Unit: "s",
				Note: fmt.Sprintf("%s: not measured: %v (each step's bound is %v)", bwhat, err, bigBound)})
			bigRuns = 0
			break
		}
		bigOwned, bigBalanced, bigOps = append(bigOwned, r.owned), append(bigBalanced, r.balanced), append(bigOps, r.opsPerSec)
		e.progress("scale run %d: %d partitions over %d lease-layer members: all registered after %.3f s, all held after %.3f s, balanced after %.3f s; %.0f lease writes/s idle; heap %.2f MiB per member",
			run+1, bigParts, bigWorkers, r.joined, r.owned, r.balanced, r.opsPerSec, r.memMiB)
	}
	// What the writes alone cost on this configuration, raw: the floor
	// of any design that writes a lease record and a fence record per
	// acquisition, one by one or in atomic batches.
	fwhat := fmt.Sprintf("raw JetStream, no leasehold: %d partitions' first writes, a create of the lease key in one bucket and then of the fence record in another (compare-and-set each), from %d connections", bigParts, bigWorkers)
	floorBound := 2 * time.Minute
	for _, f := range []struct {
		name, what string
		batch      int
	}{
		{"scale_max_write_floor", fwhat + ", every write pipelined: the least a cold start of this size costs in writes, one write each", 0},
		{"scale_max_write_floor_batched", fmt.Sprintf("%s (at most 32: the server keeps 50 atomic batches open per stream), in atomic batches of %d keys: what writes grouped by partition batches would cost", fwhat, floorBatch), floorBatch},
	} {
		var took []float64
		for run := range max(bigRuns, 1) {
			s, err := e.acquireFloor(ctx, fmt.Sprintf("fl%d-%d", f.batch, run), bigParts, bigWorkers, f.batch, floorBound)
			if err != nil {
				e.progress("%s: %v", f.name, err)
				took = nil
				rows = append(rows, Row{Name: f.name, Unit: "s", Note: fmt.Sprintf("%s: did not complete within %v on this machine (%v)", f.what, floorBound, err)})
				break
			}
			took = append(took, s)
			e.progress("%s run %d: %d partitions' lease and fence writes from %d connections in %.3f s", f.name, run+1, bigParts, bigWorkers, s)
		}
		if took != nil {
			rows = append(rows, single(f.name, "s", took, f.what))
		}
	}
	if bigRuns > 0 {
		rows = append(rows,
			single("scale_max_owned", "s", bigOwned, bwhat+": from the first start until every partition is held"),
			single("scale_max_balanced", "s", bigBalanced, bwhat+": until every member holds its share; target <= 10 s"),
			single("scale_max_renew_load", "KV ops/s", bigOps, bwhat+fmt.Sprintf(": lease bucket writes per second once balanced and idle, over %v", window)),
		)
	}

	bound := 90 * time.Second
	r, err := e.scaleRun(ctx, "scw", procParts, procWorkers, ttl, window, asProcess, bound)
	wwhat := fmt.Sprintf("%d partitions, %d %v started together, TTL %v", procParts, procWorkers, asProcess, ttl)
	if err != nil {
		e.progress("scale with worker processes: %v", err)
		return append(rows, Row{Name: "scale_workers_balanced", Unit: "s",
			Note: fmt.Sprintf("%s: not measured: %v (each step's bound is %v); see the lease-layer rows and the report", wwhat, err, bound)}), nil
	}
	e.progress("scale with %d worker processes: all registered after %.3f s, all held after %.3f s, balanced after %.3f s; %.0f lease writes/s idle; RSS %.1f MiB per worker, %.1f MiB of it its own (RssAnon)", procWorkers, r.joined, r.owned, r.balanced, r.opsPerSec, r.memMiB, r.anonMiB)
	return append(rows,
		single("scale_workers_joined", "s", []float64{r.joined}, wwhat+": until every worker process has started and registered"),
		single("scale_workers_owned", "s", []float64{r.owned}, wwhat+": until every partition is held"),
		single("scale_workers_balanced", "s", []float64{r.balanced}, wwhat+": until every worker holds its share"),
		single("scale_workers_renew_load", "KV ops/s", []float64{r.opsPerSec}, wwhat+": lease bucket writes per second once balanced and idle"),
		single("scale_rss_per_worker", "MiB", []float64{r.memMiB}, wwhat+": median resident set size of the worker processes once balanced (target <= 40)"),
		single("scale_rss_anon_per_worker", "MiB", []float64{r.anonMiB}, wwhat+": median RssAnon of the worker processes once balanced: the RSS without the binary's code and other file pages, which the workers on a host share"),
	), nil
}

func (e *env) scaleRun(ctx context.Context, prefix string, partitions, workers int, ttl, window time.Duration, mode runMode, bound time.Duration) (scaleResult, error) {
	var res scaleResult
	g, err := e.newProcGroup(ctx, prefix, partitions, ttl)
	if err != nil {
		return res, fmt.Errorf("set up: %w", err)
	}
	defer g.close(ctx)
	g.mode = mode
	heap0 := heapInUse()
	ids := make([]string, workers)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-w%d", prefix, i)
	}
	// The members start together, as a fleet's pods do: a member in this
	// process connects and opens the bucket before it runs, and one after
	// another those took seconds on a busy cluster, which counted as the
	// cold start's.
	t0 := time.Now()
	errs := make([]error, workers)
	var starting sync.WaitGroup
	for i := range workers {
		starting.Go(func() { errs[i] = g.start(ids[i]) })
	}
	starting.Wait()
	if err := errors.Join(errs...); err != nil {
		return res, fmt.Errorf("start the members: %w", err)
	}
	if err := wait(ctx, bound, "every worker registered", func() bool { return g.registered(ids) }); err != nil {
		return res, fmt.Errorf("%w (%s)", err, g.summary())
	}
	res.joined = time.Since(t0).Seconds()
	if err := wait(ctx, bound, "every partition held", g.owned); err != nil {
		return res, fmt.Errorf("%w (%s)", err, g.summary())
	}
	res.owned = time.Since(t0).Seconds()
	if err := wait(ctx, bound, "every worker holds its share", func() bool { return g.balanced(ids, false) }); err != nil {
		return res, fmt.Errorf("%w (%s)", err, g.summary())
	}
	res.balanced = time.Since(t0).Seconds()

	// Let acquisitions settle, then count the lease bucket's writes over
	// the window.
	time.Sleep(time.Second)
	info := func() (*jetstream.StreamInfo, error) {
		i, err := retry.Value(ctx, func(ctx context.Context) (*jetstream.StreamInfo, error) {
			s, err := g.js.Stream(ctx, "KV_"+g.bucket)
			if err != nil {
				return nil, err
			}
			return s.Info(ctx)
		})
		if err != nil {
			return nil, fmt.Errorf("count the lease bucket's writes: %w", err)
		}
		return i, nil
	}
	info0, err := info()
	if err != nil {
		return res, err
	}
	t1 := time.Now()
	time.Sleep(window)
	info1, err := info()
	if err != nil {
		return res, err
	}
	res.opsPerSec = float64(info1.State.LastSeq-info0.State.LastSeq) / time.Since(t1).Seconds()

	if mode != asProcess {
		res.memMiB = max(heapInUse()-heap0, 0) / float64(workers)
		return res, nil
	}
	var sizes, anon []float64
	for _, id := range ids {
		mib, err := rssMiB(g.proc(id).Pid())
		if err != nil {
			return res, fmt.Errorf("memory of %s: %w", id, err)
		}
		a, err := statusMiB(g.proc(id).Pid(), "RssAnon")
		if err != nil {
			return res, fmt.Errorf("memory of %s: %w", id, err)
		}
		sizes, anon = append(sizes, mib), append(anon, a)
	}
	res.memMiB, res.anonMiB = median(sizes), median(anon)
	return res, nil
}

// heapInUse is this process's Go heap in use after a collection, in MiB.
func heapInUse() float64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapInuse) / (1 << 20)
}

// summary summarises who holds how many partitions, for a run that does
// not converge.
func (g *procGroup) summary() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	count := map[string]int{}
	for _, s := range g.slots {
		count[s.holder]++
	}
	free := count[""]
	delete(count, "")
	return fmt.Sprintf("%d partitions free, %d members registered, held: %v", free, len(g.live), count)
}
