package main

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/worker"
)

func newJobsCancel() *cobra.Command {
	var f jobsFlags
	cmd := &cobra.Command{
		Use:   "cancel REF...",
		Short: "Cancel jobs: skip them when their turn comes, or stop them while they run",
		Long: `cancel stores a cancel for each job named. A waiting or delayed job is skipped
when its turn comes; a running job's context is cancelled (its handler sees
worker.ErrJobCancelled as the context's cause), and the effects of its attempt
are not applied, whatever its handler returns. ` + "`leasehold jobs show`" + ` then says
cancelled. A job that has finished (done, dead-lettered, replayed, purged,
removed unrun) is not cancelled: cancel says so and fails.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, refs, closeConn, err := f.open(cmd, args)
			if err != nil {
				return err
			}
			defer closeConn()
			finished := 0
			for _, r := range refs {
				st, err := p.Cancel(cmd.Context(), r)
				switch {
				case errors.Is(err, worker.ErrJobFinished):
					finished++
					fmt.Fprintf(cmd.OutOrStdout(), "job %s has finished (%s): not cancelled\n", r.Ref(), st.State)
				case err != nil:
					return err
				default:
					fmt.Fprintf(cmd.OutOrStdout(), "job %s (%s): cancel stored; it is skipped or stopped when its partition's worker sees it\n", r.Ref(), st.State)
				}
			}
			if finished > 0 {
				return fmt.Errorf("%d of %d jobs had finished and were not cancelled", finished, len(refs))
			}
			return nil
		},
	}
	f.register(cmd)
	return cmd
}
