package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/coordinator"
)

func newStatus() *cobra.Command {
	var (
		conn   natsFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Print the partition table from the lease bucket",
		Long: `status reads the lease bucket and prints, for every partition, who holds it, at
which epoch, how long ago it was acquired and renewed, the epoch its progress
was last fenced under, and the last input sequence committed; then every lock
the same way, and records in either bucket that leasehold did not write, with
what to do about each (` + "`leasehold fence --repair`" + ` repairs them).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			nc, js, err := conn.connect(ctx, "leasehold status")
			if err != nil {
				return err
			}
			defer nc.Close()
			b, err := conn.openLeaseBucket(ctx, js)
			if err != nil {
				return err
			}
			st, err := b.Snapshot(ctx)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(st)
			}
			printStatus(cmd.OutOrStdout(), st, time.Now())
			return nil
		},
	}
	conn.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the snapshot as JSON")
	return cmd
}

func printStatus(out io.Writer, st coordinator.Status, now time.Time) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tHOLDER\tEPOCH\tLEASE AGE\tRENEWED\tFENCED EPOCH\tPROGRESS")
	for _, p := range st.Partitions {
		holder, epoch, age, renewed := "-", "-", "-", "-"
		if p.Holder != "" {
			holder, epoch = p.Holder, p.Epoch.String()
			age = ago(now, p.Acquired)
			renewed = ago(now, p.Renewed)
		}
		fenced := "-"
		if p.FencedEpoch != 0 {
			fenced = p.FencedEpoch.String()
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Partition, holder, epoch, age, renewed, fenced, strconv.FormatUint(p.Progress, 10))
	}
	tw.Flush()
	if len(st.Locks) > 0 {
		fmt.Fprintln(out)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "LOCK\tHOLDER\tEPOCH\tLEASE AGE\tRENEWED\tFENCED EPOCH")
		for _, l := range st.Locks {
			holder, epoch, age, renewed := "-", "-", "-", "-"
			if l.Holder != "" {
				holder, epoch = l.Holder, l.Epoch.String()
				age = ago(now, l.Acquired)
				renewed = ago(now, l.Renewed)
			}
			fenced := "-"
			if l.FencedEpoch != 0 {
				fenced = l.FencedEpoch.String()
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", l.Name, holder, epoch, age, renewed, fenced)
		}
		tw.Flush()
	}
	fmt.Fprintf(out, "\n%d live workers: %v\n", len(st.Members), st.Members)
	for _, f := range st.Findings {
		fmt.Fprintf(out, "finding: %s\n", f)
	}
}

func ago(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	if d < 0 {
		d = 0
	}
	return d.Round(100*time.Millisecond).String() + " ago"
}
