package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// serve serves handler on addr until ctx ends, for the listener that flag
// names: unset says how to leave it unset, what what it serves. It
// returns once the listener is open, so a taken port fails the command at
// start, and a function that waits for the server to stop. (The status
// page, /metrics, /livez and /readyz are served by startPage.)
func serve(ctx context.Context, flag, addr, unset string, handler http.Handler, what string, log *slog.Logger) (wait func(), err error) {
	if addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w (pick a free address, or %s)", flag, addr, err, unset)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("http server stopped", "flag", flag, "err", err)
		}
	}()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("serving "+what, "addr", ln.Addr().String())
	return func() { <-done }, nil
}
