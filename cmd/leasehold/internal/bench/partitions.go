package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/worker"
)

// partitionWorkers is how many worker processes hold the partitions in
// the partition cost rows.
const partitionWorkers = 4

// partResult is what an idle group of worker processes costs, measured
// over a window once every partition is held and every consumer waits.
type partResult struct {
	balanced  float64 // s from the first start until every worker holds its share
	heapKiB   float64 // growth of this process's Go heap (the server's) after GC
	cpuMsPerS float64 // CPU of this process (the server's) per second of the window
	msgsPerS  float64 // messages in and out of the server per second
	rssMiB    float64 // median RssAnon of the worker processes
	wCPUMsPS  float64 // CPU per worker process per second of the window
	leaseOps  float64 // lease bucket writes per second
	fenceOps  float64 // fence bucket writes per second
}

// partitionCost measures what an idle held partition costs: the NATS
// server's memory and CPU (it runs in this process: its Go heap and this
// process's CPU time, above the same figures measured before any worker
// started), the messages it moves (each held partition has a pull request
// always waiting, which the server answers with a heartbeat every second
// and which the worker renews when it expires every 5 s), the worker
// processes' memory and CPU, and the lease and fence buckets' writes. Then
// it compares, on raw JetStream, a consumer per partition with one
// consumer per worker that filters on the worker's partitions.
func (e *env) partitionCost(ctx context.Context) ([]Row, error) {
	counts, window, runs := []int{16, 64, 256, 1024, 4096}, 10*time.Second, min(e.cfg.Runs, 2)
	if e.cfg.Quick {
		counts, window, runs = []int{16, 64}, time.Second, 1
	}
	// What this process costs idle, the server without workers: the
	// floor the rows subtract.
	heap0 := heapInUse()
	cpu0, msgs0, err := e.idleLoad(ctx, window)
	if err != nil {
		return nil, err
	}
	e.progress("partitions: idle server %.2f ms CPU/s, %.1f msgs/s, heap %.1f MiB", cpu0, msgs0, heap0)

	var rows []Row
	type series struct{ balanced, heap, cpu, msgs, rss, wcpu, lease, fence []float64 }
	all := map[int]*series{}
	for _, p := range counts {
		s := &series{}
		all[p] = s
		for run := range runs {
			r, err := e.partitionRun(ctx, fmt.Sprintf("pc%d-%d", p, run), p, window)
			if err != nil {
				return rows, fmt.Errorf("%d partitions: %w", p, err)
			}
			e.progress("partitions %d over %d worker processes, run %d: balanced after %.1f s; server %.0f KiB heap, %.2f ms CPU/s, %.0f msgs/s; workers %.1f MiB RssAnon, %.2f ms CPU/s each; lease bucket %.1f, fence bucket %.1f writes/s",
				p, partitionWorkers, run+1, r.balanced, r.heapKiB, r.cpuMsPerS, r.msgsPerS, r.rssMiB, r.wCPUMsPS, r.leaseOps, r.fenceOps)
			s.balanced = append(s.balanced, r.balanced)
			s.heap = append(s.heap, r.heapKiB/1024-heap0)
			s.cpu = append(s.cpu, r.cpuMsPerS-cpu0)
			s.msgs = append(s.msgs, r.msgsPerS-msgs0)
			s.rss, s.wcpu = append(s.rss, r.rssMiB), append(s.wcpu, r.wCPUMsPS)
			s.lease, s.fence = append(s.lease, r.leaseOps), append(s.fence, r.fenceOps)
		}
	}
	for _, p := range counts {
		s := all[p]
		what := fmt.Sprintf("%d partitions over %d `leasehold worker` processes (%d each), idle, over %v", p, partitionWorkers, p/partitionWorkers, window)
		name := fmt.Sprintf("partitions_%d_", p)
		rows = append(rows,
			single(name+"balanced", "s", s.balanced, what+": from the first start until every worker holds its share"),
			single(name+"server_heap", "MiB", s.heap, what+": growth of the server's Go heap (this process's, after GC) from before any group existed: streams, buckets, the workers' connections, a consumer and a waiting pull request per partition"),
			single(name+"server_cpu", "ms CPU/s", s.cpu, what+": CPU of this process (the server) per second above its idle floor"),
			single(name+"server_msgs", "msgs/s", s.msgs, what+": messages into and out of the server per second above its idle floor (heartbeats of the waiting pull requests, their renewals, member renewals)"),
			single(name+"worker_rss", "MiB", s.rss, what+": median RssAnon of a worker process (its own memory, without the binary's code pages)"),
			single(name+"worker_cpu", "ms CPU/s", s.wcpu, what+": CPU of one worker process per second (from /proc)"),
			single(name+"lease_load", "KV ops/s", s.lease, what+": lease bucket writes per second (member renewals)"),
			single(name+"fence_load", "KV ops/s", s.fence, what+": fence bucket writes per second (progress commits; none while idle)"),
		)
	}
	// What one more idle partition costs: the difference between the
	// largest and the smallest count, per partition, which leaves out
	// what the workers cost whatever they hold.
	lo, hi := counts[0], counts[len(counts)-1]
	slope := func(x func(*series) []float64, scale float64) []float64 {
		a, b := x(all[lo]), x(all[hi])
		out := make([]float64, 0, len(b))
		for i := range min(len(a), len(b)) {
			out = append(out, scale*(b[i]-a[i])/float64(hi-lo))
		}
		return out
	}
	what := fmt.Sprintf("what one more idle held partition costs: the figure at %d partitions less the one at %d, over the %d partitions between (%d worker processes)", hi, lo, hi-lo, partitionWorkers)
	rows = append(rows,
		single("partition_server_heap", "KiB/partition", slope(func(s *series) []float64 { return s.heap }, 1024), what+": the server's Go heap"),
		single("partition_server_cpu", "µs CPU/s/partition", slope(func(s *series) []float64 { return s.cpu }, 1000), what+": the server's CPU per second"),
		single("partition_server_msgs", "msgs/s/partition", slope(func(s *series) []float64 { return s.msgs }, 1), what+": the server's messages per second"),
		single("partition_worker_rss", "KiB/partition", slope(func(s *series) []float64 { return s.rss }, 1024*partitionWorkers), what+": a worker's RssAnon, per partition it holds"),
		single("partition_worker_cpu", "µs CPU/s/partition", slope(func(s *series) []float64 { return s.wcpu }, 1000*partitionWorkers), what+": a worker's CPU per second, per partition it holds"),
	)
	mf, err := e.multiFilter(ctx)
	return append(rows, mf...), err
}

// idleLoad measures this process's CPU (ms per second) and the server's
// messages per second over window.
func (e *env) idleLoad(ctx context.Context, window time.Duration) (cpuMsPerS, msgsPerS float64, err error) {
	m0, err := e.serverMsgs()
	if err != nil {
		return 0, 0, err
	}
	c0, t0 := cpuTime(), time.Now()
	select {
	case <-ctx.Done():
		return 0, 0, ctx.Err()
	case <-time.After(window):
	}
	m1, err := e.serverMsgs()
	if err != nil {
		return 0, 0, err
	}
	d := time.Since(t0).Seconds()
	return (cpuTime() - c0).Seconds() * 1000 / d, float64(m1-m0) / d, nil
}

// serverMsgs is the messages every server has received and sent.
func (e *env) serverMsgs() (int64, error) {
	var n int64
	for _, s := range e.srvs {
		v, err := s.Varz(&server.VarzOptions{})
		if err != nil {
			return 0, err
		}
		n += v.InMsgs + v.OutMsgs
	}
	return n, nil
}

func (e *env) partitionRun(ctx context.Context, prefix string, partitions int, window time.Duration) (partResult, error) {
	var res partResult
	g, err := e.newProcGroup(ctx, prefix, partitions, 10*time.Second)
	if err != nil {
		return res, err
	}
	defer g.close(ctx)
	ids := make([]string, partitionWorkers)
	t0 := time.Now()
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-w%d", prefix, i)
		if err := g.start(ids[i]); err != nil {
			return res, err
		}
	}
	if err := wait(ctx, 3*time.Minute, "every worker holds its share", func() bool { return g.balanced(ids, false) }); err != nil {
		return res, fmt.Errorf("%w (%s)", err, g.summary())
	}
	res.balanced = time.Since(t0).Seconds()
	// Every held partition creates its consumer and sends its first pull
	// request after its lease is taken: wait until the server has them
	// all, and a little more for the first round of heartbeats.
	err = wait(ctx, 3*time.Minute, "every held partition has its consumer", func() bool {
		s, err := g.js.Stream(ctx, worker.JobsStream(prefix))
		return err == nil && s.CachedInfo().State.Consumers >= partitions
	})
	if err != nil {
		return res, err
	}
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(2 * time.Second):
	}
	pids := make([]int, len(ids))
	for i, id := range ids {
		pids[i] = g.proc(id).Pid()
	}
	lastSeq := func(stream string) (uint64, error) {
		return retry.Value(ctx, func(ctx context.Context) (uint64, error) {
			s, err := g.js.Stream(ctx, stream)
			if err != nil {
				return 0, err
			}
			return s.CachedInfo().State.LastSeq, nil
		})
	}
	lease0, err := lastSeq("KV_" + g.bucket)
	if err != nil {
		return res, err
	}
	fence0, err := lastSeq("KV_" + coordinator.FenceBucketName(g.bucket))
	if err != nil {
		return res, err
	}
	w0, err := procsCPU(pids)
	if err != nil {
		return res, err
	}
	t1 := time.Now()
	res.cpuMsPerS, res.msgsPerS, err = e.idleLoad(ctx, window)
	if err != nil {
		return res, err
	}
	w1, err := procsCPU(pids)
	if err != nil {
		return res, err
	}
	lease1, err := lastSeq("KV_" + g.bucket)
	if err != nil {
		return res, err
	}
	fence1, err := lastSeq("KV_" + coordinator.FenceBucketName(g.bucket))
	if err != nil {
		return res, err
	}
	d := time.Since(t1).Seconds()
	res.wCPUMsPS = (w1 - w0).Seconds() * 1000 / d / partitionWorkers
	res.leaseOps, res.fenceOps = float64(lease1-lease0)/d, float64(fence1-fence0)/d
	res.heapKiB = heapInUse() * 1024
	var rss []float64
	for _, pid := range pids {
		mib, err := statusMiB(pid, "RssAnon")
		if err != nil {
			return res, err
		}
		rss = append(rss, mib)
	}
	res.rssMiB = median(rss)
	return res, nil
}
