package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/coordinator"
)

func newInit() *cobra.Command {
	var (
		conn       natsFlags
		partitions int
		replicas   int
		markerTTL  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "init",
		Short: "Provision the lease bucket and streams on a NATS server",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			nc, js, err := conn.connect(ctx, "leasehold init")
			if err != nil {
				return err
			}
			defer nc.Close()
			out := cmd.OutOrStdout()
			b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: conn.bucket, Replicas: replicas, MarkerTTL: markerTTL})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "lease bucket %s: ready (%d replicas)\n", b.Name(), replicas)
			return nil
		},
	}
	conn.register(cmd.Flags())
	cmd.Flags().IntVar(&partitions, "partitions", 16, "partitions of the job stream")
	cmd.Flags().IntVar(&replicas, "replicas", 1, "replicas of every stream and of the lease bucket (3 in production)")
	cmd.Flags().DurationVar(&markerTTL, "marker-ttl", time.Minute, "how long release and expiry markers stay in the lease bucket")
	return cmd
}
