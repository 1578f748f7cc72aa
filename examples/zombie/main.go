// Command zombie walks through epoch fencing one step at a time, with the
// real components: a JetStream lease bucket, two workers' coordinators and a
// fenced JetStream KV sink. Worker A takes partition 0 and writes; A
// pauses past its lease; B takes the partition over with a higher epoch and
// writes; A wakes up and writes with its old epoch, and the sink refuses it.
// The program prints every epoch, holder and error as it happens.
//
//	go run ./examples/zombie                       # an embedded NATS server
//	go run ./examples/zombie -nats nats://127.0.0.1:4222
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// config is what the walk-through needs to know.
type config struct {
	// NATS is the server URL. Empty starts an embedded server in a
	// temporary directory. Default $NATS_URL.
	NATS string
	// Name starts the names of the two buckets the walk-through uses:
	// "<name>-leases" and "<name>-effects". Default "zombie-walkthrough".
	// They are deleted and created again at the start of every run.
	Name string
	// TTL is the lease TTL: how long worker A's pause must last before B
	// may take over. Whole seconds, at least 1s. Default 2s.
	TTL time.Duration
	// Logger receives the components' own logs. Default: none.
	Logger *slog.Logger
}

const defaultName = "zombie-walkthrough"

func (c *config) setDefaults() {
	if c.Name == "" {
		c.Name = defaultName
	}
	if c.TTL == 0 {
		c.TTL = 2 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

var bucketName = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

func (c config) validate() error {
	var errs []error
	if !bucketName.MatchString(c.Name) {
		errs = append(errs, fmt.Errorf("-name %q: use letters, digits, '-' and '_' only (it names JetStream buckets)", c.Name))
	}
	if c.TTL < time.Second || c.TTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("-ttl %v: JetStream expires keys in whole seconds: use 1s or more, in whole seconds", c.TTL))
	}
	return errors.Join(errs...)
}

func main() {
	var cfg config
	var verbose bool
	flag.StringVar(&cfg.NATS, "nats", os.Getenv("NATS_URL"), "NATS server `URL` (default $NATS_URL; empty: start an embedded server)")
	flag.StringVar(&cfg.Name, "name", defaultName, "`prefix` of the lease and effect buckets (deleted and re-created on every run)")
	flag.DurationVar(&cfg.TTL, "ttl", 2*time.Second, "lease TTL, whole seconds")
	flag.BoolVar(&verbose, "v", false, "also log what the components do, to stderr")
	flag.Parse()
	if verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "zombie:", err)
		os.Exit(1)
	}
}

// natsServer hands out one connection per worker, as two processes would
// each have their own.
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
	dir, err := os.MkdirTemp("", "leasehold-zombie-")
	if err != nil {
		return nil, fmt.Errorf("embedded NATS: %w", err)
	}
	s, err := server.NewServer(&server.Options{
		ServerName: "zombie-walkthrough",
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
	return &natsServer{desc: "an embedded server (in this process, JetStream in " + dir + ")", embedded: s, dir: dir}, nil
}

func (s *natsServer) connect(name string) (*nats.Conn, error) {
	if s.embedded != nil {
		return nats.Connect("", nats.InProcessServer(s.embedded), nats.Name(name))
	}
	nc, err := nats.Connect(s.url, nats.Name(name))
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w (is the server up? pass -nats nats://host:4222, or leave -nats empty for an embedded server)", s.url, err)
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
