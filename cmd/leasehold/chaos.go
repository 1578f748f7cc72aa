package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newChaos() *cobra.Command {
	return &cobra.Command{
		Use:   "chaos",
		Short: "Run workers and sinks under injected faults and check the history",
		RunE:  func(*cobra.Command, []string) error { return errors.New("chaos: not built yet") },
	}
}
