package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/embedded"
	"github.com/leasehold/leasehold/internal/fleet"
)

// env is what every scenario shares: the server, and where processes log.
type env struct {
	cfg    *Config
	log    *slog.Logger
	srv    *server.Server
	url    string
	dir    string // removed on close
	logDir string

	maxRate float64 // leasehold's median jobs/s, once e2e has run

	mu    sync.Mutex
	conns []*nats.Conn
}

// startEnv starts an embedded NATS server on loopback TCP: clients in this
// process and worker processes reach it the same way, and TCP is faster
// here than the in-process pipe.
func startEnv(ctx context.Context, cfg *Config) (*env, error) {
	dir, err := os.MkdirTemp("", "leasehold-bench-")
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	srv, err := embedded.Start(embedded.Config{Name: "bench", StoreDir: dir + "/nats", Listen: true, Tweak: func(o *server.Options) {
		// Thousands of consumers and worker connections: lift the caps the
		// embedded defaults set for tests.
		o.JetStreamMaxMemory = 2 << 30
		o.MaxPayload = 8 << 20
		// nats-server caps a stream at 1000 consumers unless told
		// otherwise, also when the stream says -1 (unlimited); a worker
		// reads each partition it holds through a consumer of its own.
		o.JetStreamLimits.DefaultMaxConsumers = -1
	}})
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("bench: %w", err)
	}
	e := &env{cfg: cfg, log: cfg.Logger, srv: srv, url: srv.ClientURL(), dir: dir, logDir: cfg.LogDir}
	if e.logDir == "" {
		e.logDir = dir + "/logs"
	}
	return e, nil
}

func (e *env) close() {
	e.mu.Lock()
	for _, nc := range e.conns {
		nc.Close()
	}
	e.conns = nil
	e.mu.Unlock()
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
	os.RemoveAll(e.dir)
}

func (e *env) progress(format string, args ...any) {
	fmt.Fprintf(e.cfg.Progress, "bench: "+format+"\n", args...)
}

// connect opens a connection of its own, as each worker of a real
// deployment has; it is closed by release or when the bench ends.
func (e *env) connect(name string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(e.url, nats.Name(name), nats.MaxReconnects(-1))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to the embedded server: %w", err)
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4000))
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	e.mu.Lock()
	e.conns = append(e.conns, nc)
	e.mu.Unlock()
	return nc, js, nil
}

// release closes a connection connect opened.
func (e *env) release(nc *nats.Conn) {
	nc.Close()
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, c := range e.conns {
		if c == nc {
			e.conns = append(e.conns[:i], e.conns[i+1:]...)
			break
		}
	}
}

// dropStreams deletes every stream whose name starts with prefix, so that
// one run's data does not weigh on the next.
func (e *env) dropStreams(ctx context.Context, js jetstream.JetStream, prefixes ...string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	names := js.StreamNames(ctx)
	var drop []string
	for n := range names.Name() {
		for _, p := range prefixes {
			if strings.HasPrefix(n, p) || strings.HasPrefix(n, "KV_"+p) {
				drop = append(drop, n)
				break
			}
		}
	}
	for _, n := range drop {
		if err := js.DeleteStream(ctx, n); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			e.log.Warn("bench: drop stream", "stream", n, "err", err)
		}
	}
}

// fleetOptions are the options worker processes start with.
func (e *env) fleetOptions() fleet.Options {
	return fleet.Options{Binary: e.cfg.Binary, LogDir: e.logDir}
}

// quiet is a logger for components whose routine logs would flood the
// output.
func (e *env) quiet() *slog.Logger { return e.log }

// wait polls cond every 5ms until it holds or timeout passes.
func wait(ctx context.Context, timeout time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not within %v", what, timeout)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w", what, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}
