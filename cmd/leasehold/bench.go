package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newBench() *cobra.Command {
	return &cobra.Command{
		Use:   "bench",
		Short: "Measure leasehold against raw JetStream, fail-over and scale",
		RunE:  func(*cobra.Command, []string) error { return errors.New("bench: not built yet") },
	}
}
