// Command watermill runs leasehold workers that publish through a Watermill
// publisher, stamped by worker/wmstamp, into a downstream Watermill router
// whose handler is guarded by the fencing middleware of sink/wmsink. A
// message that worker-a stamped before it lost its partition arrives after
// worker-b took over, and the middleware drops it while worker-b's messages
// go through.
//
//	go run ./examples/watermill                        # an embedded NATS server
//	go run ./examples/watermill -nats nats://127.0.0.1:4222
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// config is what the example needs to know.
type config struct {
	// NATS is the server URL. Empty starts an embedded server in a
	// temporary directory. Default $NATS_URL.
	NATS string
	// Partitions of the job stream. Default 2.
	Partitions int
	// Jobs is the number of orders to ship. Default 8.
	Jobs int
	// Prefix names the job stream ("<prefix>-jobs") and the lease bucket
	// ("<prefix>-leases"). Default "shipping".
	Prefix string
	// Logger receives the components' own logs. Default: none.
	Logger *slog.Logger
}

const defaultPrefix = "shipping"

func (c *config) setDefaults() {
	if c.Partitions == 0 {
		c.Partitions = 2
	}
	if c.Jobs == 0 {
		c.Jobs = 8
	}
	if c.Prefix == "" {
		c.Prefix = defaultPrefix
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

var token = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

func (c config) validate() error {
	var errs []error
	if c.Partitions < 1 || c.Partitions > 256 {
		errs = append(errs, fmt.Errorf("-partitions %d: use 1 to 256", c.Partitions))
	}
	if c.Jobs < 1 || c.Jobs > 100_000 {
		errs = append(errs, fmt.Errorf("-jobs %d: use 1 to 100000", c.Jobs))
	}
	if !token.MatchString(c.Prefix) {
		errs = append(errs, fmt.Errorf("-prefix %q: use letters, digits, '-' and '_' only (it is a subject token)", c.Prefix))
	}
	return errors.Join(errs...)
}

func main() {
	var cfg config
	var verbose bool
	flag.StringVar(&cfg.NATS, "nats", os.Getenv("NATS_URL"), "NATS server `URL` (default $NATS_URL; empty: start an embedded server)")
	flag.IntVar(&cfg.Partitions, "partitions", 2, "partitions of the job stream")
	flag.IntVar(&cfg.Jobs, "jobs", 8, "orders to ship")
	flag.StringVar(&cfg.Prefix, "prefix", defaultPrefix, "`name` of the job stream and lease bucket")
	flag.BoolVar(&verbose, "v", false, "also log what the components do, to stderr")
	flag.Parse()
	if verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "watermill:", err)
		os.Exit(1)
	}
}

// natsServer hands out one connection per worker, as separate processes
// would each have their own.
type natsServer struct {
	desc     string
	url      string
	embedded *server.Server
	dir      string
}

// openNATS reaches the server at url, or starts an embedded one when url
// is empty.
func openNATS(url string) (*natsServer, error) {
	if url != "" {
		return &natsServer{desc: url, url: url}, nil
	}
	dir, err := os.MkdirTemp("", "leasehold-watermill-")
	if err != nil {
		return nil, fmt.Errorf("embedded NATS: %w", err)
	}
	s, err := server.NewServer(&server.Options{
		ServerName: "watermill-example",
		JetStream:  true,
		StoreDir:   dir,
		DontListen: true, // clients connect in-process
		NoSigs:     true,
		NoLog:      true,
	})
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded NATS: %w", err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		s.WaitForShutdown()
		os.RemoveAll(dir)
		return nil, errors.New("embedded NATS: the server did not start within 10s")
	}
	return &natsServer{desc: "an embedded server (in this process)", embedded: s, dir: dir}, nil
}

func (s *natsServer) connect(name string) (*nats.Conn, error) {
	if s.embedded != nil {
		return nats.Connect("", nats.InProcessServer(s.embedded), nats.Name(name))
	}
	nc, err := nats.Connect(s.url, nats.Name(name))
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w (is the server up, with JetStream? pass -nats nats://host:4222, or leave -nats empty for an embedded server)", s.url, err)
	}
	return nc, nil
}

func (s *natsServer) close() {
	if s.embedded != nil {
		s.embedded.Shutdown()
		s.embedded.WaitForShutdown()
		os.RemoveAll(s.dir)
	}
}
