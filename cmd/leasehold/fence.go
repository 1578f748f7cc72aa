package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

func newFence() *cobra.Command {
	var (
		conn   natsFlags
		lock   string
		repair bool
	)
	cmd := &cobra.Command{
		Use:   "fence [PARTITION | --lock NAME | --repair]",
		Short: "Fence out a partition's or lock's current holder by taking its lease with a new epoch",
		Long: `fence removes the partition's live lease (if any), acquires the partition with a
new, higher epoch — which fences its progress record, so the former holder can
no longer commit — and releases it. The worker group hands the partition out
again at once, with a higher epoch still. Use it when you suspect a zombie.
On the way it repairs what would keep the partition from being held: a lease
record leasehold did not write, a fence record that does not decode or claims
an epoch never issued, progress beyond the job stream's last sequence.
--lock NAME does the same for a lock; --repair puts right every finding
` + "`leasehold status`" + ` shows.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if n := len(args) + boolInt(lock != "") + boolInt(repair); n != 1 {
				return fmt.Errorf("give one of PARTITION, --lock NAME and --repair")
			}
			var p leasehold.Partition
			if len(args) == 1 {
				var err error
				if p, err = leasehold.ParsePartition(args[0]); err != nil {
					return fmt.Errorf("PARTITION: %w", err)
				}
			}
			ctx := cmd.Context()
			nc, js, err := conn.connect(ctx, "leasehold fence")
			if err != nil {
				return err
			}
			defer nc.Close()
			b, err := conn.openLeaseBucket(ctx, js)
			if err != nil {
				return err
			}
			host, _ := os.Hostname()
			c, err := coordinator.New(b, coordinator.Config{Worker: "fence-" + sanitize(host)})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if repair {
				findings, err := b.Findings(ctx)
				if err != nil {
					return err
				}
				for _, f := range findings {
					res, err := c.Repair(ctx, f)
					if err != nil {
						fmt.Fprintf(out, "%s: left alone: %v\n", f.Key, err)
						continue
					}
					for _, r := range res.Repaired {
						fmt.Fprintf(out, "%s: %s\n", f.Key, r)
					}
				}
				fmt.Fprintf(out, "%d findings\n", len(findings))
				return nil
			}
			what := "lock " + lock
			var res coordinator.FenceResult
			if lock != "" {
				res, err = c.FenceLock(ctx, lock)
			} else {
				what = "partition " + p.String()
				// A partition the job stream does not have is refused, not
				// fenced into a record nothing will ever read.
				if _, err := b.IssuedEpoch(ctx, leasehold.FenceID{Scope: b.Scope(), Partition: p}); errors.Is(err, coordinator.ErrUnknownFence) {
					return fmt.Errorf("PARTITION: %w", err)
				}
				res, err = c.Fence(ctx, p)
			}
			if err != nil {
				return err
			}
			for _, r := range res.Repaired {
				fmt.Fprintf(out, "%s: repaired: %s\n", what, r)
			}
			if res.Previous.Holder != "" {
				fmt.Fprintf(out, "%s: removed the lease of %s at epoch %d\n", what, res.Previous.Holder, res.Previous.Epoch)
			} else {
				fmt.Fprintf(out, "%s: was free\n", what)
			}
			fmt.Fprintf(out, "%s: fenced at epoch %d and released; writes below epoch %d are refused by sinks that have seen it\n", what, res.Epoch, res.Epoch)
			return nil
		},
	}
	conn.register(cmd.Flags())
	cmd.Flags().StringVar(&lock, "lock", "", "fence the lock on this resource name instead of a partition")
	cmd.Flags().BoolVar(&repair, "repair", false, "repair every record leasehold status reports as a finding")
	return cmd
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
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
