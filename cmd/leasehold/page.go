package main

import (
	"context"
	"log/slog"
	"net/http"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/telemetry"
)

// newEvents starts the publisher of this process's take-overs, lease
// losses or refusals to the events stream the status page reads. It never
// blocks the worker or sink: what it cannot publish it drops and counts.
func newEvents(js jetstream.JetStream, prefix, source string, tel telemetry.Config, log *slog.Logger) *statuspage.Publisher {
	return statuspage.NewPublisher(statuspage.PublisherConfig{
		JetStream: js, Prefix: prefix, Source: source, MeterProvider: tel.MeterProvider, Logger: log,
	})
}

// withPage mounts the status page on mux and feeds it until ctx ends (the
// HTTP server's context: open event streams end with it). With no address
// to serve on it does nothing. wait waits for the page to stop.
func withPage(ctx context.Context, addr string, mux *http.ServeMux, cfg statuspage.Config) (_ *http.ServeMux, wait func()) {
	if addr == "" {
		return mux, func() {}
	}
	srv := statuspage.New(cfg)
	srv.Register(mux)
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(ctx) }()
	return mux, func() { <-done }
}
