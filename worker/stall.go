package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
)

// A partition that has jobs waiting and has not moved its committed
// progress for Config.StallAfter is stalled: a handler that hangs, an
// effect subject that refuses everything before the job is dead-lettered,
// a consumer that stopped delivering, a barrier that cannot be written. A
// stall is not an error the worker can fix by itself; it is made visible:
// a WARN line when it starts, the leasehold_partition_stalled gauge, and
// Ready (the command's /readyz) failing while it lasts.

// Stall describes one stalled partition.
type Stall struct {
	Partition leasehold.Partition
	Epoch     leasehold.Epoch
	Committed uint64        // the progress it is stuck at
	For       time.Duration // since it last moved or was caught up
}

// touch records that the runner made progress or had nothing to do.
func (r *runner) touch() { r.progressAt.Store(time.Now().UnixNano()) }

// stalledFor is how long the runner has neither made progress nor been
// caught up; 0 while it is fine.
func (r *runner) stalledFor(now time.Time, after time.Duration) time.Duration {
	if r.lease.Err() != nil {
		return 0
	}
	d := now.Sub(time.Unix(0, r.progressAt.Load()))
	if d < after {
		return 0
	}
	return d
}

// Stalled returns the partitions held here that are stalled, by partition.
func (w *Worker) Stalled() []Stall {
	now := time.Now()
	w.mu.Lock()
	var out []Stall
	for _, r := range w.runners {
		if d := r.stalledFor(now, w.cfg.StallAfter); d > 0 {
			out = append(out, Stall{Partition: r.p, Epoch: r.info.Epoch, Committed: r.committedSeq.Load(), For: d})
		}
	}
	w.mu.Unlock()
	slices.SortFunc(out, func(a, b Stall) int { return int(a.Partition) - int(b.Partition) })
	return out
}

// Ready returns an error naming the stalled partitions and the effect
// subjects found without a stream (breaker.go), if any: for a readiness
// probe.
func (w *Worker) Ready(context.Context) error {
	var errs []error
	if st := w.Stalled(); len(st) > 0 {
		parts := make([]string, 0, min(len(st), 8))
		for _, s := range st[:min(len(st), 8)] {
			parts = append(parts, fmt.Sprintf("%d (at job %d for %v)", s.Partition, s.Committed, s.For.Round(time.Second)))
		}
		errs = append(errs, fmt.Errorf("worker %s: %d partitions with waiting jobs made no progress for %v: %s%s; see the worker's log",
			w.ID(), len(st), w.cfg.StallAfter, strings.Join(parts, ", "), andMore(len(st), 8)))
	}
	if subjects, n := w.unavailable(8); n > 0 {
		errs = append(errs, fmt.Errorf("worker %s: no stream stores %d effect subjects, and jobs publishing there are dead-lettered: %s%s; add each to a stream's subjects (leasehold init provisions <prefix>.out.*)",
			w.ID(), n, strings.Join(subjects, ", "), andMore(n, 8)))
	}
	return errors.Join(errs...)
}

// andMore says how many of n items past the first shown are left out.
func andMore(n, shown int) string {
	if n <= shown {
		return ""
	}
	return fmt.Sprintf(" and %d more", n-shown)
}

// watchStalls reports stalls as they start and end, and looks up the
// subjects of open breakers, until ctx ends.
func (w *Worker) watchStalls(ctx context.Context) {
	every := max(w.cfg.StallAfter/4, 100*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	probe := time.NewTicker(breakerProbe)
	defer probe.Stop()
	known := map[leasehold.Partition]bool{}
	for {
		select {
		case <-ctx.Done():
			for p := range known {
				w.tel.Metrics.SetStalled(w.ID(), p, false)
			}
			w.tel.Metrics.SetSubjectsUnavailable(w.ID(), 0)
			return
		case <-probe.C:
			w.probeBreakers(ctx)
			continue
		case <-t.C:
		}
		now := map[leasehold.Partition]bool{}
		for _, s := range w.Stalled() {
			now[s.Partition] = true
			if !known[s.Partition] {
				w.log.Warn("partition stalled: jobs are waiting and its progress has not moved", "partition", s.Partition, "epoch", s.Epoch, "committed", s.Committed, "for", s.For.Round(time.Second))
				w.tel.Metrics.SetStalled(w.ID(), s.Partition, true)
			}
		}
		for p := range known {
			if !now[p] {
				w.log.Info("partition no longer stalled", "partition", p)
				w.tel.Metrics.SetStalled(w.ID(), p, false)
			}
		}
		known = now
	}
}
