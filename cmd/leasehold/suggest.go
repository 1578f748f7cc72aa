package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// suggestDistance is how many edits away a name may be from what was typed
// to be suggested, for commands and flags alike.
const suggestDistance = 2

// flagError adds to an unknown-flag error the flags of the command that
// are spelt like it, and where to find them all.
func flagError(cmd *cobra.Command, err error) error {
	msg := err.Error()
	var typed string
	switch {
	case strings.HasPrefix(msg, "unknown flag: --"):
		typed = strings.TrimPrefix(msg, "unknown flag: --")
	case strings.HasPrefix(msg, "unknown shorthand flag: "):
		// "unknown shorthand flag: 'x' in -xyz"
		if i := strings.Index(msg, " in -"); i >= 0 {
			typed = msg[i+len(" in -"):]
		}
	default:
		return err
	}
	if i := strings.IndexByte(typed, '='); i >= 0 {
		typed = typed[:i]
	}
	var near []string
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Hidden {
			return
		}
		if editDistance(typed, f.Name) <= suggestDistance || (len(typed) > 2 && strings.HasPrefix(f.Name, typed)) {
			near = append(near, "--"+f.Name)
		}
	})
	if len(near) == 0 {
		return fmt.Errorf("%w (see `%s --help`)", err, cmd.CommandPath())
	}
	return fmt.Errorf("%w\n\nDid you mean this?\n\t%s\n(see `%s --help`)", err, strings.Join(near, "\n\t"), cmd.CommandPath())
}

// noArgsSuggest is cobra.NoArgs for a command that has subcommands: an
// argument is an unknown subcommand, with the ones spelt like it.
func noArgsSuggest(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
	if cmd.SuggestionsMinimumDistance <= 0 {
		cmd.SuggestionsMinimumDistance = suggestDistance
	}
	if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
		msg += "\n\nDid you mean this?\n\t" + strings.Join(s, "\n\t")
	}
	return fmt.Errorf("%s\n(see `%s --help`)", msg, cmd.CommandPath())
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
