package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/pflag"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/statuspage"
)

// httpFlags are the flags of `leasehold sink --kind http`.
type httpFlags struct {
	url           string
	endpoints     []string // name=URL
	routes        []string // subject=name
	routeHeader   string
	headers       []string // "Name: value"
	method        string
	contentType   string
	timeout       time.Duration
	maxBody       int
	maxRedirects  int
	maxRetryAfter time.Duration
	concurrency   int
	tlsCA         string
	tlsCert       string
	tlsKey        string
	lock          string
	lockTTL       time.Duration
	relayID       string
	maxDeliveries int
	maxBackoff    time.Duration
}

func (h *httpFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&h.url, "url", "", "for --kind http: the endpoint every effect is sent to (http or https), unless a route picks another; effects never choose a host")
	fs.StringArrayVar(&h.endpoints, "endpoint", nil, "for --kind http: a further endpoint as NAME=URL, for --route and --route-header to pick (repeatable)")
	fs.StringArrayVar(&h.routes, "route", nil, "for --kind http: SUBJECT=NAME sends the effects whose log subject matches the NATS pattern SUBJECT to endpoint NAME; the first match wins (repeatable)")
	fs.StringVar(&h.routeHeader, "route-header", "", "for --kind http: an effect header whose value names the endpoint (a name of --endpoint, never a URL)")
	fs.StringArrayVar(&h.headers, "header", nil, "for --kind http: 'Name: value' sent with every request, such as a credential; never logged (repeatable)")
	fs.StringVar(&h.method, "method", "POST", "for --kind http: the requests' method")
	fs.StringVar(&h.contentType, "content-type", "application/octet-stream", "for --kind http: the requests' Content-Type (the body is the effect's data)")
	fs.DurationVar(&h.timeout, "timeout", 10*time.Second, "for --kind http: bound of one request, from sending it to its answer")
	fs.IntVar(&h.maxBody, "max-body", 1<<20, "for --kind http: the largest body in bytes; a larger effect goes to the dead-letter stream at once")
	fs.IntVar(&h.maxRedirects, "max-redirects", 0, "for --kind http: redirects followed, to the same origin only (0: a redirect is a permanent failure)")
	fs.DurationVar(&h.maxRetryAfter, "max-retry-after", time.Minute, "for --kind http: the longest wait a 429's or 503's Retry-After may ask for")
	fs.IntVar(&h.concurrency, "concurrency", 8, "for --kind http: requests in flight at once (effects of one partition and subject go in log order)")
	fs.StringVar(&h.tlsCA, "http-tls-ca", "", "for --kind http: PEM file of the CA certificates to verify receivers with, instead of the system's")
	fs.StringVar(&h.tlsCert, "http-tls-cert", "", "for --kind http: PEM client certificate, with --http-tls-key")
	fs.StringVar(&h.tlsKey, "http-tls-key", "", "for --kind http: PEM key of --http-tls-cert")
	fs.StringVar(&h.lock, "lock", "", "for --kind http: the lock relays of this effect log share; only its holder delivers (default http-relay-<name>)")
	fs.StringVar(&h.relayID, "relay-id", "", "for --kind http: this relay's name in its lock record, logs and the requests' Leasehold-Relay-Worker (default <host>-<random>)")
	fs.DurationVar(&h.lockTTL, "lock-ttl", 10*time.Second, "for --kind http: how long the lock outlives its last renewal: a relay that dies is replaced after it")
	fs.IntVar(&h.maxDeliveries, "max-deliveries", 30, "for --kind http: tries of one effect (5xx, timeouts, refused connections, 429) before it goes to the dead-letter stream")
	fs.DurationVar(&h.maxBackoff, "max-backoff", 10*time.Second, "for --kind http: the longest wait between two tries (they double from 10ms): 30 tries of 10s at most span about 3.5 minutes")
}

// config builds the relay's configuration from the flags.
func (h *httpFlags) config(name string) (httpsink.Config, error) {
	cfg := httpsink.Config{URL: h.url, RouteHeader: h.routeHeader, Method: h.method, ContentType: h.contentType,
		Timeout: h.timeout, MaxBodyBytes: h.maxBody, MaxRedirects: h.maxRedirects, MaxRetryAfter: h.maxRetryAfter,
		Concurrency: h.concurrency, TLS: httpsink.TLSConfig{CAFile: h.tlsCA, CertFile: h.tlsCert, KeyFile: h.tlsKey},
		Lock: h.lock, Name: name}
	if h.url == "" && len(h.endpoints) == 0 {
		return cfg, errors.New("--kind http needs --url (or --endpoint with --route or --route-header)")
	}
	for _, e := range h.endpoints {
		n, u, ok := strings.Cut(e, "=")
		if !ok || n == "" {
			return cfg, fmt.Errorf("--endpoint %q: use NAME=URL", redactURL(e))
		}
		if cfg.Endpoints == nil {
			cfg.Endpoints = map[string]string{}
		}
		cfg.Endpoints[n] = u
	}
	for _, r := range h.routes {
		s, n, ok := strings.Cut(r, "=")
		if !ok {
			return cfg, fmt.Errorf("--route %q: use SUBJECT=NAME", r)
		}
		cfg.Routes = append(cfg.Routes, httpsink.Route{Subject: s, Endpoint: n})
	}
	for _, hv := range h.headers {
		k, v, ok := strings.Cut(hv, ":")
		if !ok || strings.TrimSpace(k) == "" {
			// It may hold a credential: show none of it.
			return cfg, errors.New("a --header has no name or no ':': use 'Name: value' (the value is not shown here)")
		}
		if cfg.Header == nil {
			cfg.Header = http.Header{}
		}
		cfg.Header.Add(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	return cfg, nil
}

// redactURL keeps what an error may show of a flag holding a URL: up to
// its host.
func redactURL(s string) string {
	if i := strings.Index(s, "://"); i >= 0 {
		if j := strings.IndexAny(s[i+3:], "/?#"); j >= 0 {
			return s[:i+3+j] + "/..."
		}
	}
	return s
}

// runHTTPSink runs the relay: it campaigns for its lock and, while it
// holds it, runs the stream sink runner cfg describes with the relay as
// its destination. /readyz fails while it does not hold the lock, while a
// receiver fails every request, and when the runner does.
func runHTTPSink(ctx context.Context, js jetstream.JetStream, f sinkFlags, cfg streamsink.Config, page *statuspage.Page, log *slog.Logger) error {
	hcfg, err := f.http.config(f.name)
	if err != nil {
		return err
	}
	b, ok := cfg.Verifier.(*coordinator.Bucket)
	if !ok {
		// --verify-epochs=false: the lock still lives in the lease bucket.
		if b, err = f.conn.openLeaseBucket(ctx, js); err != nil {
			return fmt.Errorf("--kind http keeps its lock in the lease bucket: %w", err)
		}
	}
	coord, err := coordinator.New(b, coordinator.Config{TTL: f.http.lockTTL, Worker: f.http.relayID, Logger: log, Observer: page.LockObserver(nil)})
	if err != nil {
		return fmt.Errorf("--lock-ttl: %w", err)
	}
	hcfg.Coordinator, hcfg.Logger, hcfg.Telemetry = coord, log, f.tel
	hcfg.OnEndpoint = page.EndpointObserver() // the status page's Destinations
	relay, err := httpsink.New(hcfg)
	if err != nil {
		return err
	}
	cfg.MaxDeliveries, cfg.MaxBackoff = f.http.maxDeliveries, f.http.maxBackoff
	var opts []httpsink.SinkOption
	if f.resumeGap > 0 {
		opts = append(opts, httpsink.ResumeAfterGap(f.resumeGap))
	}
	page.Ready(relay.Ready)
	log.Info("sink starting", "kind", "http", "name", f.name, "prefix", f.conn.prefix, "verify_epochs", f.verifyEpochs, "relay", coord.Config().Worker)
	if err := relay.RunSink(ctx, js, cfg, opts...); err != nil && ctx.Err() == nil {
		return fmt.Errorf("sink %s: %w", f.name, err)
	}
	log.Info("sink stopped", "name", f.name)
	return nil
}
