package main

import (
	"fmt"
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
	)
	cmd := &cobra.Command{
		Use:   "enqueue [DATA]",
		Short: "Enqueue jobs on the job stream",
		Long: `enqueue stores jobs on <prefix>.jobs.<partition>. With --key the partition is
the key's (Kafka's murmur2 partitioner); otherwise each job's key is its number,
which spreads them over the partitions. DATA is the job's payload (default a
small JSON document naming the job).`,
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
			var tick <-chan time.Time
			if rate > 0 {
				t := time.NewTicker(time.Duration(float64(time.Second) / rate))
				defer t.Stop()
				tick = t.C
			}
			counts := map[leasehold.Partition]int{}
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
				e, err := p.Enqueue(ctx, []byte(k), []byte(data))
				if err != nil {
					return fmt.Errorf("job %d: %w", i, err)
				}
				counts[e.Partition]++
			}
			fmt.Fprintf(cmd.OutOrStdout(), "enqueued %d jobs on %d partitions in %v\n", count, len(counts), time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	conn.register(cmd.Flags())
	cmd.Flags().IntVar(&partitions, "partitions", 0, partitionsHelp)
	cmd.Flags().IntVarP(&count, "count", "n", 1, "how many jobs")
	cmd.Flags().StringVar(&key, "key", "", "partition key for every job (default: a key per job)")
	cmd.Flags().Float64Var(&rate, "rate", 0, "jobs per second (0: as fast as the server takes them)")
	return cmd
}
