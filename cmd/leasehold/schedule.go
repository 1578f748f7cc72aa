package main

import (
	"cmp"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/worker"
)

func newSchedule() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "schedule",
		Short: "Declare or remove periodic jobs, which the NATS server fires",
		Long: `schedule declares periodic jobs from a YAML (or JSON) file, or removes them.
The NATS server fires each tick once for the whole fleet (message schedules,
nats-server 2.12+, cron from 2.14); the job stream must have been provisioned
with ` + "`leasehold init --schedules`" + `. Applying the same file again changes nothing,
not even the next tick's time. The file:

  periodic:
    - name: sweep              # default: the kind
      kind: sweep
      every: 1m                # or cron: "0 0 3 * * *" (seconds first)
      payload: {older_than: 24h}
    - kind: report
      cron: "@daily"
      timezone: Europe/Paris`,
	}
	cmd.AddCommand(newScheduleApply(), newScheduleRemove())
	return cmd
}

func newScheduleApply() *cobra.Command {
	var f jobsFlags
	cmd := &cobra.Command{
		Use:   "apply FILE",
		Short: "Declare the periodic jobs a file lists (\"-\": standard input)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			data, err := readLimited(cmd.InOrStdin(), args[0], worker.MaxPeriodicFile)
			if err != nil {
				return err
			}
			jobs, err := worker.ParsePeriodics(data)
			if err != nil {
				return err
			}
			p, closeConn, err := f.producer(cmd)
			if err != nil {
				return err
			}
			defer closeConn()
			out := cmd.OutOrStdout()
			for _, pj := range jobs {
				if err := p.Schedule(cmd.Context(), pj); err != nil {
					return err
				}
				when := "every " + pj.Every.String()
				if pj.Cron != "" {
					when = "cron " + pj.Cron
					if pj.TimeZone != "" {
						when += " (" + pj.TimeZone + ")"
					}
				}
				fmt.Fprintf(out, "periodic job %s: kind %s, %s\n", cmp.Or(pj.Name, pj.Kind), pj.Kind, when)
			}
			fmt.Fprintf(out, "%d periodic jobs declared\n", len(jobs))
			return nil
		},
	}
	f.register(cmd)
	return cmd
}

func newScheduleRemove() *cobra.Command {
	var f jobsFlags
	cmd := &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove periodic jobs by name; ticks already fired stay",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, closeConn, err := f.producer(cmd)
			if err != nil {
				return err
			}
			defer closeConn()
			for _, name := range args {
				if err := p.Unschedule(cmd.Context(), name); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "periodic job %s: removed\n", name)
			}
			return nil
		},
	}
	f.register(cmd)
	return cmd
}

// readLimited reads the file at path ("-": in), refusing one larger than
// limit bytes.
func readLimited(in io.Reader, path string, limit int64) ([]byte, error) {
	if path != "-" {
		fh, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer fh.Close()
		in = fh
	}
	data, err := io.ReadAll(io.LimitReader(in, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, limit)
	}
	return data, nil
}
