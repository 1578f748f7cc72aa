package main

import (
	"context"
	"fmt"

	"github.com/leasehold/leasehold/statuspage"
)

// startPage starts, through statuspage.Serve as a program of one's own
// does, what every long-running command serves: the publisher of this
// process's take-overs, lease losses or refusals to the events stream
// (it never blocks the worker or sink: what it cannot publish it drops and
// counts), and, on --http, the status page, /metrics, /livez and /readyz.
// Close the page after the worker or sink has stopped: it keeps serving
// until then.
func startPage(ctx context.Context, cfg statuspage.ServeConfig) (*statuspage.Page, error) {
	p, err := statuspage.Serve(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("--http %s: %w, or --http '' to serve nothing", cfg.Addr, err)
	}
	return p, nil
}
