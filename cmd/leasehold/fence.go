package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

func newFence() *cobra.Command {
	var conn natsFlags
	cmd := &cobra.Command{
		Use:   "fence PARTITION",
		Short: "Fence out a partition's current holder by taking its lease with a new epoch",
		Long: `fence removes the partition's live lease (if any), acquires the partition with a
new, higher epoch — which fences its progress record, so the former holder can
no longer commit — and releases it. The worker group hands the partition out
again at once, with a higher epoch still. Use it when you suspect a zombie.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := leasehold.ParsePartition(args[0])
			if err != nil {
				return fmt.Errorf("PARTITION: %w", err)
			}
			ctx := cmd.Context()
			nc, js, err := conn.connect(ctx, "leasehold fence")
			if err != nil {
				return err
			}
			defer nc.Close()
			b, err := coordinator.OpenBucket(ctx, js, conn.leaseBucket())
			if err != nil {
				return err
			}
			host, _ := os.Hostname()
			c, err := coordinator.New(b, coordinator.Config{Worker: "fence-" + sanitize(host)})
			if err != nil {
				return err
			}
			res, err := c.Fence(ctx, p)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if res.Previous.Holder != "" {
				fmt.Fprintf(out, "partition %d: removed the lease of %s at epoch %d\n", p, res.Previous.Holder, res.Previous.Epoch)
			} else {
				fmt.Fprintf(out, "partition %d: was free\n", p)
			}
			fmt.Fprintf(out, "partition %d: fenced at epoch %d and released; writes below epoch %d are refused by sinks that have seen it\n", p, res.Epoch, res.Epoch)
			return nil
		},
	}
	conn.register(cmd.Flags())
	return cmd
}

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '-'
		}
	}
	if len(b) == 0 {
		return "operator"
	}
	return string(b)
}
