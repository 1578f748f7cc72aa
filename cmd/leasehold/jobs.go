package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/worker"
)

func newJobs() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "Show where jobs are, or wait for them to finish",
		Long: `jobs tells where jobs are: scheduled (a delayed job before its time), pending,
running (on which worker, at which epoch), done (its handler succeeded),
dead-lettered (with the reason), replayed (its dead letter was sent back by
` + "`leasehold dlq replay`" + `: "replayed as <ref>" names the new job), purged (its dead
letter was deleted by ` + "`leasehold dlq purge`" + `), or removed-unrun (the job stream
removed it, aged out, before it ran), or cancelled (` + "`leasehold jobs cancel`" + `). A job is named by the reference ` + "`leasehold enqueue --refs`" + ` prints
(<partition>:<seq>, and <partition>:<seq>@<due>/<id> for a delayed job); "-"
reads references from standard input, one a line.`,
	}
	cmd.AddCommand(newJobsShow(), newJobsWait(), newJobsCancel())
	return cmd
}

type jobsFlags struct {
	conn       natsFlags
	partitions int
	asJSON     bool
}

func (f *jobsFlags) register(cmd *cobra.Command) {
	f.conn.register(cmd.Flags())
	cmd.Flags().IntVar(&f.partitions, "partitions", 0, "partitions of the job stream (default: the count recorded on the stream)")
	cmd.Flags().BoolVar(&f.asJSON, "json", false, "print the statuses as JSON")
}

// open connects and returns a producer that can read job status, and the
// references named by args.
func (f *jobsFlags) open(cmd *cobra.Command, args []string) (*worker.Producer, []worker.Enqueued, func(), error) {
	refs, err := readRefs(cmd.InOrStdin(), args)
	if err != nil {
		return nil, nil, nil, err
	}
	p, closeConn, err := f.producer(cmd)
	return p, refs, closeConn, err
}

// producer connects and returns a producer of the job stream of --prefix.
func (f *jobsFlags) producer(cmd *cobra.Command) (*worker.Producer, func(), error) {
	ctx := cmd.Context()
	nc, js, err := f.conn.connect(ctx, "leasehold jobs")
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*worker.Producer, func(), error) {
		nc.Close()
		return nil, nil, err
	}
	n, err := f.conn.resolvePartitions(ctx, js, f.partitions, 0)
	if err != nil {
		return fail(err)
	}
	b, err := f.conn.openLeaseBucket(ctx, js)
	if err != nil {
		return fail(err)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: f.conn.prefix, Partitions: n, Bucket: b})
	if err != nil {
		return fail(err)
	}
	return p, nc.Close, nil
}

// readRefs parses the references in args; "-" reads them from in.
func readRefs(in io.Reader, args []string) ([]worker.Enqueued, error) {
	var refs []worker.Enqueued
	for _, a := range args {
		if a != "-" {
			r, err := worker.ParseRef(a)
			if err != nil {
				return nil, err
			}
			refs = append(refs, r)
			continue
		}
		sc := bufio.NewScanner(in)
		for sc.Scan() {
			line := strings.TrimSpace(sc.Text())
			if line == "" {
				continue
			}
			r, err := worker.ParseRef(line)
			if err != nil {
				return nil, err
			}
			refs = append(refs, r)
		}
		if err := sc.Err(); err != nil {
			return nil, err
		}
	}
	if len(refs) == 0 {
		return nil, fmt.Errorf("name at least one job (a reference from leasehold enqueue --refs, or - to read them from standard input)")
	}
	return refs, nil
}

func newJobsShow() *cobra.Command {
	var f jobsFlags
	cmd := &cobra.Command{
		Use:   "show REF...",
		Short: "Print where each job is",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, refs, closeConn, err := f.open(cmd, args)
			if err != nil {
				return err
			}
			defer closeConn()
			sts := make([]worker.JobStatus, 0, len(refs))
			for _, r := range refs {
				st, err := p.Status(cmd.Context(), r)
				if err != nil {
					return err
				}
				sts = append(sts, st)
			}
			return printJobs(cmd.OutOrStdout(), sts, f.asJSON)
		},
	}
	f.register(cmd)
	return cmd
}

func newJobsWait() *cobra.Command {
	var (
		f       jobsFlags
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "wait REF...",
		Short: "Wait until every job has finished",
		Long: `wait returns once every job named has finished, and prints their statuses. A
job replayed from its dead letter is followed to its replay, which it waits for
(its line names the jobs replayed on the way). It fails when --timeout passes
first (printing where they are), and when any job did not end done:
dead-lettered, purged, removed unrun or cancelled.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, refs, closeConn, err := f.open(cmd, args)
			if err != nil {
				return err
			}
			defer closeConn()
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			sts, werr := p.Wait(ctx, refs...)
			if err := printJobs(cmd.OutOrStdout(), sts, f.asJSON); err != nil {
				return err
			}
			if werr != nil {
				return werr
			}
			failed := map[worker.JobState]int{}
			n := 0
			for _, st := range sts {
				if st.State != worker.JobDone {
					failed[st.State]++
					n++
				}
			}
			if n == 0 {
				return nil
			}
			var what []string
			for _, state := range []worker.JobState{worker.JobDeadLettered, worker.JobPurged, worker.JobRemovedUnrun, worker.JobReplayed, worker.JobCancelled} {
				if failed[state] > 0 {
					what = append(what, fmt.Sprintf("%d %s", failed[state], state))
				}
			}
			return fmt.Errorf("%d of %d jobs did not succeed: %s (see leasehold dlq list)", n, len(sts), strings.Join(what, ", "))
		},
	}
	f.register(cmd)
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Minute, "give up after this long")
	return cmd
}

func printJobs(out io.Writer, sts []worker.JobStatus, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(sts)
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tPARTITION\tSEQ\tSTATE\tHOLDER\tEPOCH\tPROGRESS\tDETAIL")
	for _, st := range sts {
		holder, epoch := "-", "-"
		if st.Holder != "" {
			holder, epoch = st.Holder, st.Epoch.String()
		}
		detail := st.Detail
		switch {
		case st.State == worker.JobScheduled:
			detail = "due " + st.Due.Format(time.RFC3339)
			if st.Detail != "" {
				detail += "; " + st.Detail
			}
		case st.State == worker.JobDeadLettered:
			detail = fmt.Sprintf("dead letter %d: %s", st.DeadLetter, st.Error)
		case st.State == worker.JobReplayed:
			detail = fmt.Sprintf("replayed as %s (dead letter %d: %s)", st.ReplayedAs, st.DeadLetter, st.Error)
		case st.State == worker.JobPurged:
			detail = fmt.Sprintf("purged (dead letter %d: %s)", st.DeadLetter, st.Error)
		}
		if len(st.Via) > 0 {
			detail = "replay of " + strings.Join(st.Via, " then ") + "; " + detail
		}
		// A dead letter's reason is a header anyone allowed to publish on
		// the dead-letter stream could write.
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%d\t%s\n", st.Ref, st.Partition, st.Seq, st.State, printable([]byte(holder), 0), epoch, st.Progress, printable([]byte(detail), 0))
	}
	return tw.Flush()
}
