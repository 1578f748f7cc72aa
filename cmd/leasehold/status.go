package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/statuspage"
)

func newStatus() *cobra.Command {
	var (
		conn     natsFlags
		asJSON   bool
		httpAddr string
		acts     actionFlags
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Print the partition table from the lease bucket",
		Long: `status reads the lease bucket and prints, for every partition, who holds it, at
which epoch, how long ago it was acquired and renewed (a partition held by its
worker's member session is renewed with the session: "(session)"), the epoch
its progress was last fenced under, and the last input sequence committed; then every lock
the same way, and records in either bucket that leasehold did not write, with
what to do about each (` + "`leasehold fence --repair`" + ` repairs them). Epochs
show their last digits ("…447291"); --json gives them whole.

With --http it serves the same as a live web page until interrupted, with
each partition's lag, the take-overs, lease losses and refused writes of the
last hour (from the <prefix>-events stream that workers and sinks publish
to) and the dead letters. Workers and sinks serve the page on their own
--http address too.

Actions: with --actions-token-file (or the environment variable
LEASEHOLD_ACTIONS_TOKEN) or --actions-identity-header, the page also replays
and purges dead letters and cancels jobs, as ` + "`leasehold dlq replay`" + `, ` + "`dlq purge`" + `
and ` + "`jobs cancel`" + ` do. A browser signs in with the token; a program sends it as
"Authorization: Bearer <token>". Every action is a POST from the page's own
origin with a CSRF token, is logged, and shows on every status page as an
event: who, what, result. The token is never a flag value, which ps would show.`,
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
			if httpAddr != "" {
				actions, err := acts.config()
				if err != nil {
					return err
				}
				return servePage(ctx, cmd.OutOrStdout(), js, b, conn.prefix, httpAddr, actions)
			}
			if acts.set() {
				return errors.New("the --actions-* flags need --http: actions are taken on the page")
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
	cmd.Flags().StringVar(&httpAddr, "http", "", "serve a live status page on this address (such as :8090) instead of printing once")
	acts.register(cmd)
	return cmd
}

func printStatus(out io.Writer, st coordinator.Status, now time.Time) {
	parts, locks := statuspage.Rows(st, now)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tHOLDER\tEPOCH\tLEASE AGE\tRENEWED\tFENCED EPOCH\tPROGRESS")
	for _, r := range parts {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.Holder, statuspage.ShortEpoch(r.Epoch), r.Age, r.Renewed, statuspage.ShortEpoch(r.Fenced), r.Progress)
	}
	tw.Flush()
	if len(locks) > 0 {
		fmt.Fprintln(out)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "LOCK\tHOLDER\tEPOCH\tLEASE AGE\tRENEWED\tFENCED EPOCH")
		for _, r := range locks {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.Holder, statuspage.ShortEpoch(r.Epoch), r.Age, r.Renewed, statuspage.ShortEpoch(r.Fenced))
		}
		tw.Flush()
	}
	fmt.Fprintf(out, "\n%d live workers: %v\n", len(st.Members), st.Members)
	for _, f := range st.Findings {
		fmt.Fprintf(out, "finding: %s\n", f)
	}
}

// servePage serves the live status page on addr until ctx ends, with
// /livez and /readyz (NATS reachable), and logs where it is.
func servePage(ctx context.Context, out io.Writer, js jetstream.JetStream, b *coordinator.Bucket, prefix, addr string, actions statuspage.ActionsConfig) error {
	p, err := startPage(ctx, statuspage.ServeConfig{
		JetStream: js, Bucket: b, Prefix: prefix, Name: "leasehold status", Addr: addr, Lag: true,
		DeadLetters: statuspage.DefaultDeadLetters(prefix, true, true), Logger: slog.New(slog.NewTextHandler(out, nil)),
		Actions: actions,
	})
	if err != nil {
		return err
	}
	<-ctx.Done()
	p.Close()
	return nil
}

func ago(now, t time.Time) string { return statuspage.Ago(now, t) }
