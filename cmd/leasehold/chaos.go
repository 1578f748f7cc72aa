package main

import (
	"errors"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/testing/chaos"
)

// errCheckFailed makes the command exit non-zero after it printed why.
var errCheckFailed = errors.New("chaos: the checker found violations (see above)")

func newChaos() *cobra.Command {
	var (
		cfg     chaos.Config
		asJSON  bool
		verbose bool
		faults  []string
	)
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "Run workers and sinks under injected faults and check the history",
		Long: `chaos starts NATS inside this process (one server, or a 3-node cluster with
--cluster), runs workers and a KV sink runner as separate processes of this
binary, and beside the KV sink two HTTP relays (sink --kind http, sharing one
lock) that send the same effects to a receiver in this process behind an
httpsink.Verifier; it enqueues jobs throughout, and for --duration injects
faults: SIGSTOP
past the lease TTL (zombie workers that write with their old epoch when they
wake), SIGKILL, SIGTERM, sink crashes, NATS server restarts or cluster node
kills, a network partition of one worker (as root with ip and nft), forged
or garbage messages in the effect log, and markers and acquisitions forged
from real ones (abort markers and finals copied from effects of jobs, a
barrier and an effect with the live holder's epoch and a made-up acquisition
token, an effect with an epoch the lease bucket issued to another fence),
a relay paused past its lock's TTL with a request of its on the wire, relays
killed, and the receiver down (503 or connections refused). It
then waits for the sink to catch up, checks the recorded history — no stale
or unverified application, every job applied exactly once, no effect of a
job attempt that did not complete applied (the attempts as the effect log
and the workers record them), epochs strictly rising, one holder per epoch,
and liveness: no partition with pending jobs and a live holder goes without
progress for longer than the TTL + 5s (time a fault took away left out), and
no job is left unapplied at the end; at the HTTP receiver, every job's
effect handled once after the Verifier's dedupe, none lost, none of a zombie
or of a superseded relay — and prints the figures, the longest
stall among them, and how many forged copies of a holder's exact stamp were
applied (what a credential that may publish effects can always do, counted
apart). It exits non-zero when the checker finds a violation.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Faults = faults
			if verbose {
				cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
			}
			res, err := chaos.Run(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			rep := res.Report(cfg)
			out := cmd.OutOrStdout()
			if asJSON {
				err = rep.WriteJSON(out)
			} else {
				err = rep.WriteTable(out)
			}
			if err != nil {
				return err
			}
			if !rep.OK {
				return errCheckFailed
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.DurationVar(&cfg.Duration, "duration", time.Minute, "how long to inject faults")
	fs.BoolVar(&cfg.Cluster, "cluster", false, "run a 3-node NATS cluster (streams and buckets at 3 replicas) instead of one server")
	fs.BoolVar(&asJSON, "json", false, "print the figures as one JSON object")
	fs.IntVar(&cfg.Workers, "workers", 3, "worker processes (one more runs in a network namespace when partitions are possible)")
	fs.IntVar(&cfg.Partitions, "partitions", 8, "partitions of the job stream")
	fs.DurationVar(&cfg.TTL, "ttl", 2*time.Second, "lease TTL of the workers")
	fs.IntVar(&cfg.PartitionConcurrency, "partition-concurrency", 8, "jobs of one partition each worker runs at once, in order per key (1: one at a time)")
	fs.DurationVar(&cfg.WorkTime, "work-time", 50*time.Millisecond, "time each job takes between its stamp and its effect")
	fs.IntVar(&cfg.Rate, "rate", 25, "jobs enqueued per second")
	fs.DurationVar(&cfg.FaultGap, "fault-gap", 2*time.Second, "mean quiet time between faults")
	fs.StringSliceVar(&faults, "faults", nil, "fault types to inject (default all): "+strings.Join(chaos.FaultNames(), ", "))
	fs.DurationVar(&cfg.Settle, "settle", 2*time.Minute, "how long to wait for the sink to catch up after the faults")
	fs.StringVar(&cfg.Dir, "dir", "", "directory for stores, histories and logs (default: a temporary one, kept only when the check fails)")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of the fault schedule (default: random; printed)")
	fs.BoolVar(&verbose, "verbose", false, "log the harness's progress to stderr")
	fs.BoolVar(&cfg.Unfenced, "unsafe-no-fence", false, "run the sink without fencing, to see the checker catch stale applications")
	_ = fs.MarkHidden("unsafe-no-fence")
	fs.BoolVar(&cfg.HTTPUnverified, "unsafe-no-verifier", false, "run the HTTP receiver without its Verifier, to see the checker catch a superseded relay's requests and repeated keys")
	_ = fs.MarkHidden("unsafe-no-verifier")
	return cmd
}
