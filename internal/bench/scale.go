package bench

import (
	"context"
	"fmt"
	"time"
)

// scale starts many worker processes at once on a stream with thousands of
// partitions and measures how long until every partition is held, and
// until every worker holds its share; then, with the group idle, the lease
// bucket's write rate (renewals) and each process's resident memory.
func (e *env) scale(ctx context.Context) ([]Row, error) {
	partitions, workers, runs, ttl := 4096, 32, min(e.cfg.Runs, 3), 10*time.Second
	if e.cfg.Quick {
		partitions, workers, runs, ttl = 256, 4, 1, 3*time.Second
	}
	// Leases renew every TTL/3 from when they were taken: a window of one
	// TTL sees every lease renew three times, whatever the phase.
	window := ttl
	var owned, balanced, ops, rss []float64
	for run := range runs {
		o, b, k, r, err := e.scaleRun(ctx, fmt.Sprintf("sc%d", run), partitions, workers, ttl, window, false)
		if err != nil {
			return nil, err
		}
		owned, balanced, ops, rss = append(owned, o), append(balanced, b), append(ops, k), append(rss, r)
		e.progress("scale run %d: %d partitions over %d workers: all held after %.3f s, balanced after %.3f s; %.0f lease writes/s idle; RSS %.1f MiB per worker",
			run+1, partitions, workers, o, b, k, r)
	}
	what := fmt.Sprintf("%d partitions, %d `leasehold worker` processes started together, TTL %v", partitions, workers, ttl)
	return []Row{
		single("scale_owned", "s", owned, what+": from the first process start until every partition is held; target <= 5 s"),
		single("scale_balanced", "s", balanced, what+": until every worker holds its share"),
		single("scale_renew_load", "KV ops/s", ops, what+fmt.Sprintf(": lease bucket writes per second once balanced and idle, over %v (renewals every TTL/3, and member keys)", window)),
		single("scale_rss_per_worker", "MiB", rss, what+": median resident set size of the worker processes once balanced"),
	}, nil
}

func (e *env) scaleRun(ctx context.Context, prefix string, partitions, workers int, ttl, window time.Duration, inProcess bool) (owned, balanced, opsPerSec, rss float64, err error) {
	g, err := e.newProcGroup(ctx, prefix, partitions, ttl)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	g.inProcess = inProcess
	defer g.close(ctx)
	ids := make([]string, workers)
	t0 := time.Now()
	for i := range workers {
		ids[i] = fmt.Sprintf("%s-w%d", prefix, i)
		if err := g.start(ids[i]); err != nil {
			return 0, 0, 0, 0, err
		}
	}
	if err := wait(ctx, 5*time.Minute, "every partition held", g.owned); err != nil {
		return 0, 0, 0, 0, err
	}
	owned = time.Since(t0).Seconds()
	if err := wait(ctx, 5*time.Minute, "every worker holds its share", func() bool { return g.balanced(ids, false) }); err != nil {
		return 0, 0, 0, 0, err
	}
	balanced = time.Since(t0).Seconds()

	// Let acquisitions and their consumers settle, then count the lease
	// bucket's writes over the window.
	time.Sleep(time.Second)
	s, err := g.js.Stream(ctx, "KV_"+g.bucket)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	info0, err := s.Info(ctx)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	t1 := time.Now()
	time.Sleep(window)
	info1, err := s.Info(ctx)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	opsPerSec = float64(info1.State.LastSeq-info0.State.LastSeq) / time.Since(t1).Seconds()

	if inProcess {
		return owned, balanced, opsPerSec, 0, nil
	}
	var sizes []float64
	for _, id := range ids {
		mib, err := rssMiB(g.proc(id).Pid())
		if err != nil {
			return 0, 0, 0, 0, fmt.Errorf("memory of %s: %w", id, err)
		}
		sizes = append(sizes, mib)
	}
	return owned, balanced, opsPerSec, median(sizes), nil
}
