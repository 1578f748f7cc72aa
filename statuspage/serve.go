package statuspage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
)

// ServeConfig configures Serve. JetStream is required; everything else
// has a default.
type ServeConfig struct {
	JetStream jetstream.JetStream
	// Prefix is the job streams' prefix. Default "leasehold".
	Prefix string
	// Bucket is the lease bucket, for the page's partitions and locks.
	// Without it the page shows the events and dead letters only.
	Bucket *coordinator.Bucket
	// Name is this process in the events it publishes (a worker's ID, a
	// sink's name). Default: the host name.
	Name string
	// ServedBy names this process at the top of the page. Default: Name.
	ServedBy string
	// Addr is the address to serve the page, /metrics, /livez and /readyz
	// on, such as ":8080". "" serves nothing: the events are still
	// published.
	Addr string
	// Metrics is what /metrics serves, when the process has its own
	// (telemetry.Setup's handler); give its providers in Telemetry. By
	// default Serve makes a Prometheus meter provider of its own
	// (telemetry.NewPrometheus): pass Page.Telemetry() to the Telemetry of
	// every worker, producer and sink for their metrics to show there.
	Metrics   http.Handler
	Telemetry telemetry.Config
	// Ready are /readyz's checks besides NATS's; Page.Ready adds more
	// (a worker's Ready, once it is built).
	Ready []telemetry.ReadyFunc
	// Lag turns on reading each partition's waiting jobs for the page (a
	// short-lived consumer per partition on the job stream, which this
	// process must be allowed to create).
	Lag bool
	// DeadLetters are the dead-letter streams the page shows. Default:
	// DefaultDeadLetters(Prefix, true, true).
	DeadLetters []DeadLetterStream
	// Actions turns on the page's actions: replay or purge a dead letter,
	// cancel a job, behind a token or a proxy's identity header. Off by
	// default. Each is logged and published as an event.
	Actions ActionsConfig
	Logger  *slog.Logger
}

// Page is what Serve started: the publisher of this process's events,
// whose observers go into the configurations of its workers, locks and
// sinks, and the HTTP server of the page, /metrics, /livez and /readyz.
// Close stops it.
type Page struct {
	*Publisher

	tel       telemetry.Config
	ownMeters func(context.Context) error // shuts down the meter provider Serve made
	addr      string                      // the address served, "" for none
	log       *slog.Logger

	mu    sync.Mutex
	ready []telemetry.ReadyFunc

	stopPage context.CancelFunc
	pageDone chan struct{}
	srv      *http.Server
	srvDone  chan struct{}
	once     sync.Once
}

// Serve gives a program of its own what `leasehold worker` and
// `leasehold sink` have: the events of its workers, locks and sinks on the
// status page, and, on cfg.Addr, the page, /metrics, /livez and /readyz.
// It returns once the address is listened on (a taken port is an error
// here, not later) and serves until Close, so that /metrics and the
// events of a worker's drain outlive the context that stops the worker;
// ctx bounds Serve alone.
//
// Plug its observers into the configurations before building them:
//
//	page, err := statuspage.Serve(ctx, statuspage.ServeConfig{JetStream: js, Bucket: leases, Prefix: "orders", Name: "shop-1", Addr: ":8080"})
//	...
//	defer page.Close()
//	w, err := worker.New(worker.Config{..., Observer: page.WorkerObserver(nil), Telemetry: page.Telemetry()})
//	db, err := pgsink.New(pgsink.Config{..., Observer: page.SinkObserver(), Telemetry: page.Telemetry()})
//	lock := coordinator.Config{..., Observer: page.LockObserver(nil)}
//	page.Ready(w.Ready)
//
// The events go to the stream <prefix>-events, which `leasehold init`,
// worker.ProvisionJobs and ProvisionEvents create; without it the page
// says so, and the events are dropped and counted.
func Serve(ctx context.Context, cfg ServeConfig) (*Page, error) {
	if cfg.JetStream == nil {
		return nil, errors.New("statuspage: Serve needs ServeConfig.JetStream")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "leasehold"
	}
	if cfg.Name == "" {
		cfg.Name, _ = os.Hostname()
	}
	if cfg.ServedBy == "" {
		cfg.ServedBy = cfg.Name
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.DeadLetters == nil {
		cfg.DeadLetters = DefaultDeadLetters(cfg.Prefix, true, true)
	}
	p := &Page{tel: cfg.Telemetry, log: cfg.Logger, ready: cfg.Ready}
	metrics := cfg.Metrics
	if metrics == nil {
		mp, h, err := telemetry.NewPrometheus()
		if err != nil {
			return nil, err
		}
		p.tel.MeterProvider, metrics, p.ownMeters = mp, h, mp.Shutdown
	}
	var meters metric.MeterProvider = p.tel.MeterProvider // nil: the global one
	p.Publisher = NewPublisher(PublisherConfig{JetStream: cfg.JetStream, Prefix: cfg.Prefix, Source: cfg.Name, MeterProvider: meters, Logger: cfg.Logger})
	if cfg.Addr == "" {
		return p, nil
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", cfg.Addr)
	if err != nil {
		p.Close()
		return nil, fmt.Errorf("statuspage: serve on %s: %w (pick a free address)", cfg.Addr, err)
	}
	p.addr = ln.Addr().String()
	checks := []telemetry.ReadyFunc{natsReady(cfg.JetStream), p.checkReady}
	mux := telemetry.Mux(metrics, checks...)
	page := New(Config{
		JetStream: cfg.JetStream, Bucket: cfg.Bucket, Prefix: cfg.Prefix, ServedBy: cfg.ServedBy, Lag: cfg.Lag,
		DeadLetters: cfg.DeadLetters, Logger: cfg.Logger, Actions: cfg.Actions, Events: p.Publisher,
	})
	page.Register(mux)
	pctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	p.stopPage, p.pageDone = stop, make(chan struct{})
	go func() { defer close(p.pageDone); page.Run(pctx) }()
	p.srv, p.srvDone = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, make(chan struct{})
	go func() {
		defer close(p.srvDone)
		if err := p.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			cfg.Logger.Error("the status page's HTTP server stopped", "addr", p.addr, "err", err)
		}
	}()
	cfg.Logger.Info("serving the status page at "+p.URL()+", with /metrics, /livez and /readyz", "addr", p.addr)
	return p, nil
}

// natsReady is telemetry.NATSReady for the connection js uses.
func natsReady(js jetstream.JetStream) telemetry.ReadyFunc {
	return telemetry.NATSReady(js.Conn(), js)
}

// Telemetry returns the providers whose metrics /metrics serves, for the
// Telemetry of the process's workers, producers and sinks.
func (p *Page) Telemetry() telemetry.Config { return p.tel }

// Ready adds checks to /readyz, such as a worker's Ready or a sink
// runner's, once they are built.
func (p *Page) Ready(checks ...telemetry.ReadyFunc) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ready = append(p.ready, checks...)
}

func (p *Page) checkReady(ctx context.Context) error {
	p.mu.Lock()
	checks := append([]telemetry.ReadyFunc(nil), p.ready...)
	p.mu.Unlock()
	var errs []error
	for _, check := range checks {
		if err := check(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Addr is the address the page is served on, such as "[::]:8080"; ""
// when ServeConfig.Addr was.
func (p *Page) Addr() string { return p.addr }

// URL is the page's address for a browser, such as
// "http://localhost:8080/"; "" when it is not served.
func (p *Page) URL() string {
	if p.addr == "" {
		return ""
	}
	host, port, err := net.SplitHostPort(p.addr)
	if err != nil {
		return "http://" + p.addr + "/"
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "localhost" // listening on every address
	}
	return "http://" + net.JoinHostPort(host, port) + "/"
}

// Close stops serving, ends the open pages, and publishes what events are
// still queued (for up to the publish timeout). Call it after the workers
// and sinks have stopped, so that their last events go out. It is safe to
// call twice.
func (p *Page) Close() {
	p.once.Do(func() {
		if p.srv != nil {
			p.stopPage()
			<-p.pageDone // open event streams end with the page
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if err := p.srv.Shutdown(ctx); err != nil {
				_ = p.srv.Close()
			}
			cancel()
			<-p.srvDone
		}
		p.Publisher.Close()
		if p.ownMeters != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = p.ownMeters(ctx)
			cancel()
		}
	})
}
