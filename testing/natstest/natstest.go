// Package natstest starts real nats-server instances with JetStream inside a
// test process: a single server, and a three-node cluster on loopback whose
// nodes can be killed and restarted. Servers live in temporary directories
// and stop when the test ends.
//
// Import it from tests only. No production package of leasehold imports it,
// so binaries that do not import it do not link it.
package natstest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/embedded"
)

// Option configures a server started by Start or StartCluster.
type Option func(*options)

type options struct {
	listen     bool
	syncAlways bool
	tweak      func(*server.Options)
}

// Listen makes the server accept TCP clients on a loopback port, so
// connections reconnect across Restart and other processes can connect.
func Listen() Option { return func(o *options) { o.listen = true } }

// SyncAlways makes the server fsync every write before acknowledging it,
// the production setting (sync_interval: always).
func SyncAlways() Option { return func(o *options) { o.syncAlways = true } }

// Tweak adjusts the server options last: authentication, TLS, limits.
func Tweak(f func(*server.Options)) Option { return func(o *options) { o.tweak = f } }

// Server is one embedded nats-server. Its store survives Restart.
type Server struct {
	tb   testing.TB
	cfg  embedded.Config
	mu   sync.Mutex
	srv  *server.Server
	down bool
}

// readyTimeout bounds a test server's start. Under the race detector, on
// a machine the rest of a test run keeps busy, starting JetStream took
// more than embedded's default of 10 s once (a node of a cluster, in CI);
// a test's own waits bound the rest.
const readyTimeout = time.Minute

// Start starts a single JetStream server in a temporary directory. It stops
// when the test ends.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	cfg := embedded.Config{
		Name:         "natstest",
		StoreDir:     tb.TempDir(),
		Listen:       o.listen,
		SyncAlways:   o.syncAlways,
		Tweak:        o.tweak,
		ReadyTimeout: readyTimeout,
	}
	if o.listen {
		ports, err := embedded.FreePorts("127.0.0.1", 1)
		if err != nil {
			tb.Fatal(err)
		}
		cfg.Port = ports[0]
	}
	s := &Server{tb: tb, cfg: cfg}
	s.start()
	tb.Cleanup(s.Shutdown)
	return s
}

func (s *Server) start() {
	s.tb.Helper()
	srv, err := embedded.Start(s.cfg)
	if err != nil {
		s.tb.Fatal(err)
	}
	s.mu.Lock()
	s.srv, s.down = srv, false
	s.mu.Unlock()
}

// NATS returns the running nats-server.
func (s *Server) NATS() *server.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.srv
}

// URL is the server's client URL, or "" when it does not listen.
func (s *Server) URL() string {
	if !s.cfg.Listen {
		return ""
	}
	return "nats://" + embedded.Addr("127.0.0.1", s.cfg.Port)
}

// StoreDir is the JetStream store directory.
func (s *Server) StoreDir() string { return s.cfg.StoreDir }

// Connect opens a client connection, closed when the test ends. A listening
// server is reached over TCP with unlimited reconnects; otherwise the
// connection is in-process and does not survive Restart.
func (s *Server) Connect(tb testing.TB, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	var nc *nats.Conn
	var err error
	if s.cfg.Listen {
		nc, err = nats.Connect(s.URL(), append(reconnectOpts(), opts...)...)
	} else {
		nc, err = nats.Connect("", append([]nats.Option{nats.InProcessServer(s.NATS())}, opts...)...)
	}
	if err != nil {
		tb.Fatalf("natstest: connect: %v", err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// JetStream connects and returns a JetStream context.
func (s *Server) JetStream(tb testing.TB, opts ...nats.Option) jetstream.JetStream {
	tb.Helper()
	return newJetStream(tb, s.Connect(tb, opts...))
}

// Shutdown stops the server and waits for it. It is safe to call twice.
func (s *Server) Shutdown() {
	s.mu.Lock()
	srv, down := s.srv, s.down
	s.down = true
	s.mu.Unlock()
	if srv != nil && !down {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Restart stops the server and starts it again on the same store (and port).
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Shutdown()
	s.start()
}

// Running reports whether the server is up.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.down
}

func reconnectOpts() []nats.Option {
	return []nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(50 * time.Millisecond),
		nats.ReconnectJitter(10*time.Millisecond, 10*time.Millisecond),
		nats.Timeout(2 * time.Second),
	}
}

func newJetStream(tb testing.TB, nc *nats.Conn) jetstream.JetStream {
	tb.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("natstest: jetstream: %v", err)
	}
	return js
}

// WaitJetStream waits until the JetStream API answers on nc, which in a
// cluster means a meta leader has been elected.
func WaitJetStream(tb testing.TB, js jetstream.JetStream, timeout time.Duration) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err = js.AccountInfo(ctx)
		cancel()
		if err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	tb.Fatalf("natstest: JetStream not ready after %v: %v", timeout, err)
}

func fatalf(tb testing.TB, format string, args ...any) {
	tb.Helper()
	tb.Fatal(fmt.Sprintf(format, args...))
}
