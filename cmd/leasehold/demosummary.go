package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// demoSummary is what --json prints.
type demoSummary struct {
	JobsEnqueued         int         `json:"jobs_enqueued"`
	JobsProcessed        int         `json:"jobs_processed"`
	JobsLost             int         `json:"jobs_lost"`
	JobsUnfinished       int         `json:"jobs_unfinished"`
	EffectsAccepted      int         `json:"effects_accepted"`
	EffectsDuplicate     int         `json:"effects_duplicate"`
	EffectsRejectedStale int         `json:"effects_rejected_stale"`
	StaleApplied         int         `json:"stale_applied"`
	ZombiePauses         int         `json:"zombie_pauses"`
	ZombieWorker         string      `json:"zombie_worker"`
	FailoverMillis       float64     `json:"failover_ms"`
	Elapsed              string      `json:"elapsed"`
	Workers              int         `json:"workers"`
	Partitions           int         `json:"partitions"`
	Rejected             []rejection `json:"rejected"`
	Takeovers            []takeover  `json:"takeovers"`
}

// rejection is one refused zombie write. Epochs are lease-bucket
// revisions, 16 digits long: the _short fields are their last digits, as
// the text output shows them.
type rejection struct {
	At         string `json:"at"`
	Partition  uint32 `json:"partition"`
	Epoch      uint64 `json:"epoch"`
	EpochShort string `json:"epoch_short"`
	Max        uint64 `json:"max_epoch"`
	MaxShort   string `json:"max_epoch_short"`
	Worker     string `json:"worker"`
	Key        string `json:"key"`
}

// takeover is one partition changing hands, as the sink saw it: the
// barrier of the new holder's first epoch.
type takeover struct {
	At         string `json:"at"`
	Partition  uint32 `json:"partition"`
	From       string `json:"from"`
	To         string `json:"to"`
	Epoch      uint64 `json:"epoch"`
	EpochShort string `json:"epoch_short"`
}

// demoJob is an enqueued job: its partition and sequence.
type demoJob struct {
	p   leasehold.Partition
	seq uint64
}

func (d *demo) summary(ctx context.Context, kv *kvsink.Sink, b *coordinator.Bucket) demoSummary {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := demoSummary{
		JobsEnqueued:         len(d.enqueued),
		EffectsAccepted:      d.accepted,
		EffectsDuplicate:     d.duplicates + d.accepted - len(d.applied),
		EffectsRejectedStale: len(d.stale),
		StaleApplied:         d.staleApplied,
		ZombiePauses:         d.pauses,
		FailoverMillis:       float64(d.failover.Milliseconds()),
		Elapsed:              time.Since(d.start).Round(100 * time.Millisecond).String(),
		Workers:              d.cfg.workers,
		Partitions:           d.cfg.partitions,
		Rejected:             d.stale,
		Takeovers:            d.takeovers,
	}
	if s.Rejected == nil {
		s.Rejected = []rejection{}
	}
	if s.Takeovers == nil {
		s.Takeovers = []takeover{}
	}
	// A job is processed when its effect is in the sink's bucket; the
	// bucket, not the runner's bookkeeping, is the proof. One that is not
	// is lost when its partition's fence record says it was committed,
	// and otherwise unfinished: the run ended before a worker ran it
	// (a slow machine), and it waits in the job stream.
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	committed := map[leasehold.Partition]coordinator.Committed{}
	for key, j := range d.enqueued {
		if _, ok, err := kv.Get(rctx, key); err == nil && ok {
			s.JobsProcessed++
			continue
		}
		c, read := committed[j.p]
		if !read {
			var err error
			if c, err = b.PartitionCommitted(rctx, j.p); err != nil {
				// Unknown is not unfinished: count it lost, saying why
				// (on stderr: d.mu is held, and --json owns stdout).
				fmt.Fprintf(os.Stderr, "demo: partition %d's committed progress: %v; its jobs not applied count as lost\n", j.p, err)
				c = coordinator.Committed{Seq: ^uint64(0)}
			}
			committed[j.p] = c
		}
		if c.Includes(j.seq) {
			s.JobsLost++
		} else {
			s.JobsUnfinished++
		}
	}
	for _, r := range d.stale {
		if s.ZombieWorker == "" {
			s.ZombieWorker = r.Worker
		}
	}
	return s
}

func printSummary(out io.Writer, s demoSummary) {
	fmt.Fprintf(out, `
== summary (%s, %d workers, %d partitions)
jobs enqueued            %d
jobs processed           %d
jobs lost                %d (committed, and no effect in the sink)
jobs unfinished          %d (not run when the run ended; they wait in the stream)
effects accepted         %d
  of them repeats        %d (jobs re-run after the take-over; the sink keyed them once)
zombie writes refused    %d
stale effects applied    %d
take-overs               %d
worker freezes           %d
fail-over                %.0f ms (from the freeze to the last of the frozen worker's partitions handling a job again)
`, s.Elapsed, s.Workers, s.Partitions, s.JobsEnqueued, s.JobsProcessed, s.JobsLost, s.JobsUnfinished, s.EffectsAccepted, s.EffectsDuplicate,
		s.EffectsRejectedStale, s.StaleApplied, len(s.Takeovers), s.ZombiePauses, s.FailoverMillis)
	if len(s.Rejected) > 0 {
		fmt.Fprintf(out, "\nThe frozen worker woke up and wrote with epochs it no longer held; the sink refused %s.\n", plural(len(s.Rejected), "that write", "all %d of those writes"))
		fmt.Fprintln(out, "Every job it did not finish was done by the new holders: nothing lost, nothing stale applied.")
	}
}

// epochDigits is how many last digits of an epoch the demo shows: epochs
// start at the bucket's creation time in microseconds, so they run to 16
// digits, and within one run they differ in the last few.
const epochDigits = 4

// shortEpoch is e's last digits, as "…1234"; --json gives both forms.
func shortEpoch(e leasehold.Epoch) string {
	s := e.String()
	if len(s) <= epochDigits {
		return s
	}
	return "…" + s[len(s)-epochDigits:]
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return fmt.Sprintf(many, n)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
