package bench

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
)

const (
	groupPartitions = 16
	groupWorkers    = 4
	feedInterval    = 20 * time.Millisecond
)

// failover kills (SIGKILL) and stops (SIGTERM) worker processes in turn,
// each holding its share of the partitions while jobs flow, and times how
// long until every partition it held produces effects again under a new
// epoch. After each, a fresh process takes the victim's place and the
// group is left to balance before the next.
func (e *env) failover(ctx context.Context) ([]Row, error) {
	// A quick run keeps the TTL: with 1 s (renewals every 333 ms, each
	// request bounded by 166 ms), race-built processes on a busy machine
	// lost their leases faster than the group could balance.
	ttl, rounds := 3*time.Second, max(e.cfg.Runs, 6)
	if e.cfg.Quick {
		rounds = 1
	}
	g, err := e.newProcGroup(ctx, "fo", groupPartitions, ttl)
	if err != nil {
		return nil, err
	}
	defer g.close(ctx)
	if _, err := g.feed(ctx, feedInterval); err != nil {
		return nil, err
	}
	for i := range groupWorkers {
		if err := g.start(fmt.Sprintf("fo-w%d", i)); err != nil {
			return nil, err
		}
	}
	if err := wait(ctx, 3*time.Minute, "worker processes balance", func() bool { return g.balanced(g.running(), true) }); err != nil {
		return nil, fmt.Errorf("%w (%s)", err, g.unbalanced(g.running()))
	}
	var crash, graceful []float64
	next := groupWorkers
	// Kills and stops alternate, so that drift weighs on both alike.
	for i := range 2 * rounds {
		kill := i%2 == 0
		ids := g.running()
		slices.Sort(ids)
		victim := ids[i%len(ids)]
		parts := g.holdings(victim)
		p := g.proc(victim)
		t0 := time.Now()
		if kill {
			err = p.Kill()
		} else {
			err = p.Term()
		}
		if err != nil {
			return nil, err
		}
		var at time.Time
		err = wait(ctx, 3*ttl+30*time.Second, "the victim's partitions resume", func() bool {
			var ok bool
			at, ok = g.resumed(parts)
			return ok
		})
		if err != nil {
			return nil, err
		}
		took := at.Sub(t0).Seconds()
		what := "SIGTERM"
		if kill {
			crash, what = append(crash, took), "SIGKILL"
		} else {
			graceful = append(graceful, took)
		}
		e.progress("failover %d: %s of %s holding %d partitions: all of them working again after %.3f s", i+1, what, victim, len(parts), took)
		if err := p.Wait(ctx); err != nil && !kill {
			e.log.Warn("bench: a stopped worker exited with an error", "worker", victim, "err", err)
		}
		if err := g.start(fmt.Sprintf("fo-w%d", next)); err != nil {
			return nil, err
		}
		next++
		if err := wait(ctx, 3*time.Minute, "worker processes balance", func() bool { return g.balanced(g.running(), true) }); err != nil {
			return nil, fmt.Errorf("%w (%s)", err, g.unbalanced(g.running()))
		}
	}
	k := groupPartitions / groupWorkers
	crashNote := fmt.Sprintf("SIGKILL of a worker process holding %d of %d partitions, lease TTL %v, jobs on every partition every %v; until every one of them produced an effect under a new epoch; target p99 <= TTL + 1 s = %v",
		k, groupPartitions, ttl, feedInterval, ttl+time.Second)
	termNote := fmt.Sprintf("SIGTERM of a worker process holding %d partitions (drain, commit, release); until every one of them produced an effect under a new epoch; target <= 1 s", k)
	return []Row{
		Row{Name: "failover_crash_p50", Value: percentile(crash, 0.5), Unit: "s", Runs: len(crash), Note: crashNote},
		Row{Name: "failover_crash_p99", Value: percentile(crash, 0.99), Unit: "s", Runs: len(crash), Note: crashNote + " (nearest rank: the largest of few kills)"},
		Row{Name: "handoff_graceful_p50", Value: percentile(graceful, 0.5), Unit: "s", Runs: len(graceful), Note: termNote},
		Row{Name: "handoff_graceful_p99", Value: percentile(graceful, 0.99), Unit: "s", Runs: len(graceful), Note: termNote + " (nearest rank)"},
	}, nil
}

// scaleOut adds worker processes to a group under load and times how long
// until the group is balanced again, with every partition working under
// its new owner, then removes them again (SIGTERM). A stream sink runner
// fences the effect log meanwhile and counts the writes it refuses: planned
// hand-offs should cause none.
func (e *env) scaleOut(ctx context.Context) ([]Row, error) {
	from, to := 2, groupWorkers
	g, err := e.newProcGroup(ctx, "so", groupPartitions, 10*time.Second)
	if err != nil {
		return nil, err
	}
	defer g.close(ctx)
	var rejected, applied atomic.Int64
	count := sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		switch {
		case d.Outcome.Dropped():
			rejected.Add(1)
		case d.Outcome == sink.Accepted:
			applied.Add(1)
		}
	})
	mem := sink.NewMemory(sink.MemoryConfig{Logger: e.quiet(), NoDedupe: true})
	rnc, rjs, err := e.connect("bench scale-out sink")
	if err != nil {
		return nil, err
	}
	runner, err := streamsink.New(ctx, rjs, streamsink.Config{
		Prefix:   "so",
		Replicas: e.replicas(),
		Handler:  func(ctx context.Context, eff sink.Effect) error { return mem.Apply(ctx, eff) },
		Observer: count,
		Logger:   e.quiet(),
	})
	if err != nil {
		e.release(rnc)
		return nil, err
	}
	g.stops = append(g.stops, e.goRun(ctx, func(ctx context.Context) { _ = runner.Run(ctx) }, func() { e.release(rnc) }))
	if _, err := g.feed(ctx, feedInterval); err != nil {
		return nil, err
	}
	next := 0
	add := func(n int) error {
		for range n {
			if err := g.start(fmt.Sprintf("so-w%d", next)); err != nil {
				return err
			}
			next++
		}
		return nil
	}
	if err := add(from); err != nil {
		return nil, err
	}
	if err := wait(ctx, 3*time.Minute, "worker processes balance", func() bool { return g.balanced(g.running(), true) }); err != nil {
		return nil, fmt.Errorf("%w (%s)", err, g.unbalanced(g.running()))
	}
	var out, in []float64
	for run := range e.cfg.Runs {
		t0 := time.Now()
		if err := add(to - from); err != nil {
			return nil, err
		}
		if err := wait(ctx, time.Minute, "the grown group balances", func() bool {
			ids := g.running()
			return len(ids) == to && g.balanced(ids, true)
		}); err != nil {
			return nil, err
		}
		out = append(out, time.Since(t0).Seconds())

		// Back to the smaller group: SIGTERM the oldest, so that every round
		// moves partitions both ways.
		ids := g.running()
		slices.Sort(ids)
		t1 := time.Now()
		for _, id := range ids[:to-from] {
			if err := g.proc(id).Term(); err != nil {
				return nil, err
			}
		}
		if err := wait(ctx, time.Minute, "the shrunk group balances", func() bool {
			ids := g.running()
			return len(ids) == from && g.balanced(ids, true)
		}); err != nil {
			return nil, err
		}
		in = append(in, time.Since(t1).Seconds())
		e.progress("scale-out run %d: %d -> %d workers balanced in %.3f s, back to %d in %.3f s; %d writes refused so far", run+1, from, to, out[run], from, in[run], rejected.Load())
	}
	// Let the runner reach the end of the log before counting.
	time.Sleep(500 * time.Millisecond)
	note := fmt.Sprintf("%d partitions under load, %d -> %d worker processes (from starting the processes, which takes part of it), until balanced with every partition working under its new owner", groupPartitions, from, to)
	return []Row{
		single("scaleout_balanced", "s", out, note),
		single("scalein_balanced", "s", in, fmt.Sprintf("%d -> %d worker processes by SIGTERM, until balanced and working", to, from)),
		{Name: "scaleout_rejected_writes", Value: float64(rejected.Load()), Unit: "writes", Runs: len(out),
			Note: fmt.Sprintf("effects the stream sink runner refused over all %d scale-out and scale-in rounds (%d applied); target 0", len(out), applied.Load())},
	}, nil
}
