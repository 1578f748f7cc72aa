// Command leasehold runs leasehold's demo and operator tools.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRoot().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "leasehold:", err)
		os.Exit(1)
	}
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "leasehold",
		Short:         "Partitioned workers with epoch fencing on NATS JetStream",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			return applySettings(cmd)
		},
	}
	// Misspelt commands and flags get the names spelt like them.
	root.SuggestionsMinimumDistance = suggestDistance
	root.SetFlagErrorFunc(flagError)
	root.PersistentFlags().String("config", "", "YAML file of settings (long flag names as keys); env LEASEHOLD_CONFIG")
	root.AddCommand(newDemo(), newInit(), newWorkerCmd(), newSinkCmd(), newEnqueue(), newJobs(), newSchedule(), newStatus(), newFence(), newDLQ(), newChaos(), newBench())
	return root
}
