package main

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

func newEnqueue() *cobra.Command {
	var (
		conn       natsFlags
		partitions int
		count      int
		key        string
		rate       float64
		kind       string
		id         string
		at         string
		in         time.Duration
		refs       bool
		unique     time.Duration
		uniqueKey  string
	)
	cmd := &cobra.Command{
		Use:   "enqueue [DATA]",
		Short: "Enqueue jobs on the job stream",
		Long: `enqueue stores jobs on <prefix>.jobs.<partition>. With --key the partition is
the key's (Kafka's murmur2 partitioner); otherwise each job's key is its number,
which spreads them over the partitions. DATA is the job's payload (default a
small JSON document naming the job).

--kind sets the job's kind (the Leasehold-Kind header a worker's Mux routes by).
--id gives the job an ID: a job enqueued again with the same ID within the
stream's duplicate window is not stored again, and enqueue says so. --at TIME
(RFC 3339) or --in DURATION makes delayed jobs, which the NATS server stores on
their partitions at that time. --refs prints each job's reference, which
` + "`leasehold jobs show`" + ` and ` + "`leasehold jobs wait`" + ` take.
--unique PERIOD stores a job once per kind and payload (or per --unique-key)
for PERIOD, across producers and restarts; a copy within it is not stored, and
enqueue names the job stored first.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			nc, js, err := conn.connect(ctx, "leasehold enqueue")
			if err != nil {
				return err
			}
			defer nc.Close()
			if partitions, err = conn.resolvePartitions(ctx, js, partitions, 0); err != nil {
				return err
			}
			p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: conn.prefix, Partitions: partitions})
			if err != nil {
				return err
			}
			var opts []worker.EnqueueOption
			if kind != "" {
				opts = append(opts, worker.WithKind(kind))
			}
			switch {
			case at != "" && in != 0:
				return fmt.Errorf("--at and --in both set: give one due time")
			case at != "":
				t, err := time.Parse(time.RFC3339, at)
				if err != nil {
					return fmt.Errorf("--at %q: write an RFC 3339 time such as 2026-01-02T15:04:05Z: %w", at, err)
				}
				opts = append(opts, worker.EnqueueAt(t))
			case in < 0:
				return fmt.Errorf("--in %v: a delay cannot be negative", in)
			case in > 0:
				opts = append(opts, worker.EnqueueIn(in))
			}
			switch {
			case unique < 0:
				return fmt.Errorf("--unique %v: a period cannot be negative", unique)
			case uniqueKey != "" && unique == 0:
				return fmt.Errorf("--unique-key needs --unique PERIOD")
			case uniqueKey != "":
				opts = append(opts, worker.UniqueKey(uniqueKey, unique))
			case unique > 0:
				opts = append(opts, worker.Unique(unique))
			}
			if id != "" && count > 1 {
				return fmt.Errorf("--id with --count %d: one ID names one job", count)
			}
			if math.IsNaN(rate) || rate < 0 {
				return fmt.Errorf("--rate %v: give jobs per second, or 0 for as fast as the server takes them", rate)
			}
			var tick <-chan time.Time
			// A rate above a job a nanosecond is no limit.
			if every := time.Duration(float64(time.Second) / rate); rate > 0 && every > 0 {
				t := time.NewTicker(every)
				defer t.Stop()
				tick = t.C
			}
			counts := map[leasehold.Partition]int{}
			duplicates := 0
			start := time.Now()
			for i := range count {
				if tick != nil {
					select {
					case <-ctx.Done():
						return ctx.Err()
					case <-tick:
					}
				}
				k := key
				if k == "" {
					k = fmt.Sprintf("job-%d-%d", start.UnixNano(), i)
				}
				data := fmt.Sprintf(`{"job":%d,"key":%q}`, i, k)
				if len(args) == 1 {
					data = args[0]
				}
				jobOpts := opts
				if id != "" {
					jobOpts = append(jobOpts, worker.JobID(id))
				}
				e, err := p.Enqueue(ctx, []byte(k), []byte(data), jobOpts...)
				if dup := (*worker.DuplicateJobError)(nil); errors.As(err, &dup) {
					duplicates++
					fmt.Fprintf(cmd.OutOrStdout(), "job %d is not stored: %v\n", i, dup)
					continue
				}
				if err != nil {
					return fmt.Errorf("job %d: %w", i, err)
				}
				if e.Duplicate {
					duplicates++
					fmt.Fprintf(cmd.OutOrStdout(), "job %s is a duplicate: the stream holds a job with that ID at %s (within its duplicate window), and did not store this one\n", e.ID, e.Ref())
					continue
				}
				if refs {
					fmt.Fprintln(cmd.OutOrStdout(), e.Ref())
				}
				counts[e.Partition]++
			}
			fmt.Fprintf(cmd.OutOrStdout(), "enqueued %d jobs on %d partitions in %v\n", count-duplicates, len(counts), time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	conn.register(cmd.Flags())
	cmd.Flags().IntVar(&partitions, "partitions", 0, partitionsHelp)
	cmd.Flags().IntVarP(&count, "count", "n", 1, "how many jobs")
	cmd.Flags().StringVar(&key, "key", "", "partition key for every job (default: a key per job)")
	cmd.Flags().Float64Var(&rate, "rate", 0, "jobs per second (0: as fast as the server takes them)")
	cmd.Flags().StringVar(&kind, "kind", "", "the jobs' kind, which a worker's Mux routes by")
	cmd.Flags().StringVar(&id, "id", "", "the job's ID (Nats-Msg-Id): a repeat within the duplicate window is not stored")
	cmd.Flags().StringVar(&at, "at", "", "delay the jobs until this RFC 3339 time (the server schedules them)")
	cmd.Flags().DurationVar(&in, "in", 0, "delay the jobs by this long (the server schedules them)")
	cmd.Flags().DurationVar(&unique, "unique", 0, "store a job once per kind and payload for this long (see --unique-key)")
	cmd.Flags().StringVar(&uniqueKey, "unique-key", "", "with --unique: store a job once per this key instead")
	cmd.Flags().BoolVar(&refs, "refs", false, "print each job's reference, for leasehold jobs show|wait")
	return cmd
}
