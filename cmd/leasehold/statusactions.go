package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/statuspage"
)

// actionsTokenEnv holds the status page's actions token, for a deployment
// that passes secrets in the environment rather than in a file.
const actionsTokenEnv = "LEASEHOLD_ACTIONS_TOKEN"

// minActionsToken is the shortest token taken: one that can be guessed
// is no lock.
const minActionsToken = 16

// actionFlags turn on the status page's actions.
type actionFlags struct {
	tokenFile string
	header    string
	origins   []string
}

func (f *actionFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&f.tokenFile, "actions-token-file", "", "with --http: turn on the page's actions (replay or purge a dead letter, cancel a job) for whoever signs in with the token in this file (or set "+actionsTokenEnv+")")
	fs.StringVar(&f.header, "actions-identity-header", "", "with --http: turn on the page's actions for the user a reverse proxy in front of the page names in this header (such as X-Forwarded-User); trusted only when set, and the proxy must strip it from clients")
	fs.StringSliceVar(&f.origins, "actions-origin", nil, "with --http: another origin the page is opened at (https://status.example.com), for a proxy that rewrites Host")
}

// set reports whether any of the actions' flags was given. The
// environment's token is not asked for: a shell that exports it still
// prints the table.
func (f *actionFlags) set() bool {
	return f.tokenFile != "" || f.header != "" || len(f.origins) > 0
}

// config reads the token and returns the page's actions configuration:
// off unless a token or an identity header is given.
func (f *actionFlags) config() (statuspage.ActionsConfig, error) {
	cfg := statuspage.ActionsConfig{IdentityHeader: strings.TrimSpace(f.header), Origins: f.origins}
	env := os.Getenv(actionsTokenEnv)
	switch {
	case f.tokenFile != "" && env != "":
		return cfg, fmt.Errorf("give the actions token in --actions-token-file or in %s, not both", actionsTokenEnv)
	case f.tokenFile != "":
		b, err := os.ReadFile(f.tokenFile)
		if err != nil {
			return cfg, fmt.Errorf("--actions-token-file: %w", err)
		}
		cfg.Token = strings.TrimSpace(string(b))
		if cfg.Token == "" {
			return cfg, fmt.Errorf("--actions-token-file %s is empty", f.tokenFile)
		}
	case env != "":
		cfg.Token = strings.TrimSpace(env)
	}
	if cfg.Token != "" && len(cfg.Token) < minActionsToken {
		return cfg, fmt.Errorf("the actions token is %d bytes, fewer than %d: make one with `openssl rand -hex 32`", len(cfg.Token), minActionsToken)
	}
	if strings.ContainsAny(cfg.Token, "\r\n") {
		return cfg, errors.New("the actions token holds a line break: put it on one line")
	}
	for _, o := range cfg.Origins {
		if !strings.HasPrefix(o, "http://") && !strings.HasPrefix(o, "https://") || strings.Count(o, "/") != 2 {
			return cfg, fmt.Errorf("--actions-origin %q: write scheme://host[:port], such as https://status.example.com", o)
		}
	}
	return cfg, nil
}
