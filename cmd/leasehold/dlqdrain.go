package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/statuspage/deadletter"
)

func newDLQReplay() *cobra.Command {
	var (
		f   dlqFlags
		all bool
	)
	cmd := &cobra.Command{
		Use:   "replay SEQ... | --all",
		Short: "Send dead letters back where they came from, then delete them",
		Long: `replay publishes each dead letter again where it came from and deletes it once
the server has acknowledged the replay. Fix what made it fail first.

Jobs (the default): the job goes back on its job subject, the Leasehold-Subject
header, which must be stored by <prefix>-jobs. It keeps its payload and its own
headers; the dead-letter headers, the worker's stamp and Nats-* headers are not
copied. It is a new job at the end of its partition, with a new sequence and
job ID, and runs after the jobs already waiting there; but it keeps its
identity: it carries Leasehold-Origin (<scope>/<partition>/<seq>, where the job
was first stored: the dead letter's own Leasehold-Origin, or its Leasehold-Seq
for a dead letter written before origins were), and its effects take the keys
they had at its first run, so a sink that dedupes applies what the job applied
before once. A dead letter whose origin cannot be read is refused and kept.
Before the dead letter is deleted, a record of the replay is stored beside it,
so that ` + "`leasehold jobs show`" + ` of the job says "replayed as <partition>:<seq>" and
` + "`leasehold jobs wait`" + ` follows it to the replay.

Effects (--sink): the effect goes back on its effect log subject, the
Leasehold-Sink-Subject header, which must be stored by --log (default
<prefix>-effects), with its stamp (Leasehold-Scope, -Partition, -Epoch,
-Acquisition, -Key, -Worker) and trace context only: not the job headers
(Leasehold-Job, -Attempt, -Effects, -After, -Abort) that tie it to its job's
attempt, which the sink has settled. It stands alone: the sink fences it by its
epoch and dedupes it by its key like any effect that stands alone. If the
partition changed hands since it was written, its epoch is below the fence and
the sink refuses it (counted and logged); then re-run the job instead.

Both carry Leasehold-Replay-Of (<dead-letter stream>/<sequence>) and
Leasehold-Replay-Reason (the error that dead-lettered them, on one line, at
most 512 bytes).

A replay is at least once. The dead letter is deleted only after the replay is
stored, so a failed delete, or a stop between the two, leaves it in place and a
second replay sends it again. Within the target stream's duplicate window
(2 minutes by default) the server drops that second copy, since each replay's
message ID is derived from its dead letter; after it, the job runs twice, under
the same keys, which a sink that dedupes applies once.

A dead letter without its original subject, or whose subject no stream stores
or another stream than the expected one stores, is refused and kept: look at
it with show, then purge it. --all replays every dead letter stored when the
command starts, oldest first, and stops at the first it cannot replay.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			all = all && cmd.Flags().Changed("all")
			seqs, err := parseTargets(args, all)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			d, err := f.open(ctx, "replay")
			if err != nil {
				return err
			}
			defer d.nc.Close()
			out := cmd.OutOrStdout()
			n := 0
			replay := func(m *jetstream.RawStreamMsg) (bool, error) {
				if err := d.replay(ctx, out, m); err != nil {
					return false, fmt.Errorf("%w\n%d replayed before it", err, n)
				}
				n++
				return true, nil
			}
			if all {
				if _, err := d.each(ctx, 1, replay); err != nil {
					return err
				}
			}
			for _, seq := range seqs {
				m, err := d.get(ctx, seq)
				if err == nil {
					_, err = replay(m)
				}
				if err != nil {
					return err
				}
			}
			fmt.Fprintf(out, "%d replayed\n", n)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&all, "all", false, "replay every dead letter (command line only)")
	cmd.Flags().StringVar(&f.log, "log", "", "with --sink: the effect log replayed effects go to (default <prefix>-effects)")
	return cmd
}

// replayMsg builds the message a replay of dead letter m publishes
// (deadletter.Stream.ReplayMsg).
func (d *dlq) replayMsg(m *jetstream.RawStreamMsg) (*nats.Msg, error) {
	if d.lib == nil {
		return deadletter.Named(d.name, d.prefix, d.sink).ReplayMsg(m)
	}
	return d.lib.ReplayMsg(m)
}

// replay publishes dead letter m again, waits for the acknowledgement and
// only then deletes it (deadletter.Stream.Replay), and says so.
func (d *dlq) replay(ctx context.Context, out io.Writer, m *jetstream.RawStreamMsg) error {
	r, err := d.lib.Replay(ctx, m)
	if err != nil {
		return err
	}
	note := ""
	if r.Duplicate {
		note = ", stored by an earlier replay"
	}
	fmt.Fprintf(out, "replayed %d to %s (%s sequence %d%s); dead letter deleted\n", m.Sequence, r.Subject, r.Stream, r.Seq, note)
	return nil
}

func newDLQPurge() *cobra.Command {
	var (
		f        dlqFlags
		all, yes bool
	)
	cmd := &cobra.Command{
		Use:   "purge SEQ... | --all",
		Short: "Delete dead letters for good",
		Long: `purge deletes the dead letters at the given sequences, or with --all every dead
letter stored when the command starts (later ones are kept). A purged job or
effect is gone: show it first, and keep its payload (show --raw) if it may be
needed. Before a job's dead letters are deleted, a record of each purge is
stored beside them, so that ` + "`leasehold jobs show`" + ` says "purged", not "done".
Without --yes, purge lists what it would delete, deletes nothing and
exits non-zero. --yes and --all count only on the command line, never from the
environment or a config file.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			all = all && cmd.Flags().Changed("all")
			yes = yes && cmd.Flags().Changed("yes")
			seqs, err := parseTargets(args, all)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			d, err := f.open(ctx, "purge")
			if err != nil {
				return err
			}
			defer d.nc.Close()
			out := cmd.OutOrStdout()
			l := d.lister(out)
			var st jetstream.StreamState
			var purged []*jetstream.RawStreamMsg // with their headers, for the records
			if all {
				st, err = d.each(ctx, 1, func(m *jetstream.RawStreamMsg) (bool, error) {
					if l.n < 100 {
						l.add(d, m)
					} else {
						l.n++
					}
					if d.lib.Records() {
						m.Data = nil
						purged = append(purged, m)
					}
					return true, nil
				})
				if err != nil {
					return err
				}
				if l.n == 0 {
					fmt.Fprintf(out, "no dead letters in %s\n", d.name)
					return nil
				}
			}
			for _, seq := range seqs {
				m, err := d.get(ctx, seq)
				if err != nil {
					return err
				}
				l.add(d, m)
				purged = append(purged, m)
			}
			l.tw.Flush()
			if all && l.n > 100 {
				fmt.Fprintf(out, "... and %d more\n", l.n-100)
			}
			if !yes {
				return fmt.Errorf("nothing deleted: run again with --yes to delete the %d dead letters above", l.n)
			}
			if err := d.lib.RecordPurges(ctx, purged); err != nil {
				return err
			}
			if all {
				// Up to the last one listed: a dead letter stored since
				// was not shown, so it stays. The records stay too.
				opts := []jetstream.StreamPurgeOpt{jetstream.WithPurgeSequence(st.LastSeq + 1)}
				if d.lib.Records() {
					opts = append(opts, jetstream.WithPurgeSubject(d.prefix+".dlq.*"))
				}
				if err := d.s.Purge(ctx, opts...); err != nil {
					return fmt.Errorf("purge %s: %w", d.name, err)
				}
				fmt.Fprintf(out, "deleted %d dead letters from %s (sequences up to %d)\n", l.n, d.name, st.LastSeq)
				return nil
			}
			for i, seq := range seqs {
				if err := d.s.DeleteMsg(ctx, seq); err != nil {
					return fmt.Errorf("delete dead letter %d of %s: %w (%d deleted before it)", seq, d.name, err, i)
				}
			}
			fmt.Fprintf(out, "deleted %d dead letters from %s\n", len(seqs), d.name)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&all, "all", false, "every dead letter (command line only)")
	cmd.Flags().BoolVar(&yes, "yes", false, "delete for real (command line only)")
	return cmd
}

// parseTargets reads the SEQ arguments of replay and purge: some, or none
// with --all.
func parseTargets(args []string, all bool) ([]uint64, error) {
	switch {
	case all && len(args) > 0:
		return nil, errors.New("give sequences or --all, not both")
	case all:
		return nil, nil
	case len(args) == 0:
		return nil, errors.New("name the dead letters by sequence (see `leasehold dlq list`), or pass --all")
	}
	return parseSeqs(args)
}
