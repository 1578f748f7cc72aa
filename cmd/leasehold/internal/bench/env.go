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

// env is what every scenario shares: the servers, the replica count every
// stream and bucket is created with, and where processes log. Scenarios
// create their streams through replicas() and connect through connect or
// url, so each runs unchanged on one server or on the cluster.
type env struct {
	cfg    *Config
	log    *slog.Logger
	srvs   []*server.Server
	url    string // every node's client URL, comma-separated
	dir    string // removed on close
	logDir string

	maxRate float64 // leasehold's median jobs/s, once e2e has run

	mu    sync.Mutex
	conns []*nats.Conn
}

// startEnv starts an embedded NATS server, or with Config.Cluster three
// clustered in this process, on loopback TCP: clients in this process and
// worker processes reach them the same way, and TCP is faster here than
// the in-process pipe. With Config.Sync every node syncs each write to
// disk before acknowledging it (sync_interval: always).
func startEnv(ctx context.Context, cfg *Config) (*env, error) {
	dir, err := os.MkdirTemp("", "leasehold-bench-")
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	e := &env{cfg: cfg, log: cfg.Logger, dir: dir, logDir: cfg.LogDir}
	if e.logDir == "" {
		e.logDir = dir + "/logs"
	}
	tweak := func(o *server.Options) {
		// Thousands of consumers and worker connections: lift the caps the
		// embedded defaults set for tests.
		o.JetStreamMaxMemory = 2 << 30
		o.MaxPayload = 8 << 20
		// nats-server caps a stream at 1000 consumers unless told
		// otherwise, also when the stream says -1 (unlimited); a worker
		// reads each partition it holds through a consumer of its own.
		o.JetStreamLimits.DefaultMaxConsumers = -1
	}
	nodes := []embedded.Config{{Name: "bench", StoreDir: dir + "/nats", Listen: true, SyncAlways: cfg.Sync, Tweak: tweak}}
	if cfg.Cluster {
		ports, err := embedded.FreePorts("127.0.0.1", 2*clusterSize)
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("bench: %w", err)
		}
		var routes []string
		for i := range clusterSize {
			routes = append(routes, embedded.Addr("127.0.0.1", ports[clusterSize+i]))
		}
		nodes = nodes[:0]
		for i := range clusterSize {
			name := fmt.Sprintf("bench-%c", 'a'+i)
			nodes = append(nodes, embedded.Config{Name: name, StoreDir: dir + "/" + name, Listen: true, Port: ports[i], SyncAlways: cfg.Sync, Tweak: tweak,
				Cluster: &embedded.ClusterConfig{Name: "bench", Port: ports[clusterSize+i], Routes: routes}})
		}
	}
	// Start the nodes together: each is ready for clients before it has
	// routes to the others.
	var urls []string
	for _, n := range nodes {
		srv, err := embedded.Start(n)
		if err != nil {
			e.close()
			return nil, fmt.Errorf("bench: %w", err)
		}
		e.srvs = append(e.srvs, srv)
		urls = append(urls, srv.ClientURL())
	}
	e.url = strings.Join(urls, ",")
	if err := e.waitJetStream(ctx); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

// clusterSize is the number of nodes of the --cluster configuration.
const clusterSize = 3

// replicas is the replica count of every stream and bucket the scenarios
// create: 3 on the cluster, as deployments run them.
func (e *env) replicas() int {
	if e.cfg.Cluster {
		return clusterSize
	}
	return 1
}

// waitJetStream waits until JetStream answers, which on a cluster means it
// has elected a meta leader.
func (e *env) waitJetStream(ctx context.Context) error {
	nc, js, err := e.connect("bench wait")
	if err != nil {
		return err
	}
	defer e.release(nc)
	return wait(ctx, time.Minute, "JetStream ready", func() bool {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(actx)
		return err == nil
	})
}

// Configuration names the server configuration cfg measures, as the table
// heading says it.
func (cfg Config) Configuration() string {
	what := "1 server, R1"
	if cfg.Cluster {
		what = fmt.Sprintf("%d-node cluster, R%d", clusterSize, clusterSize)
	}
	if cfg.Sync {
		return what + ", sync_interval always"
	}
	return what + ", default sync (2 min)"
}

func (e *env) close() {
	e.mu.Lock()
	for _, nc := range e.conns {
		nc.Close()
	}
	e.conns = nil
	e.mu.Unlock()
	for _, srv := range e.srvs {
		srv.Shutdown()
	}
	for _, srv := range e.srvs {
		srv.WaitForShutdown()
	}
	os.RemoveAll(e.dir)
}

func (e *env) progress(format string, args ...any) {
	fmt.Fprintf(e.cfg.Progress, "bench: "+format+"\n", args...)
}

// connect opens a connection of its own, as each worker of a real
// deployment has; it is closed by release or when the bench ends.
func (e *env) connect(name string, opts ...jetstream.JetStreamOpt) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(e.url, nats.Name(name), nats.MaxReconnects(-1))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to the embedded server: %w", err)
	}
	js, err := jetstream.New(nc, append([]jetstream.JetStreamOpt{jetstream.WithPublishAsyncMaxPending(4000)}, opts...)...)
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

// waitReplicas waits until each stream has a leader and every replica is
// current, so that a measurement that starts once a stream is created
// counts the work it measures, not the replicas' first election.
func (e *env) waitReplicas(ctx context.Context, js jetstream.JetStream, streams ...string) error {
	if e.replicas() == 1 {
		return nil
	}
	for _, name := range streams {
		err := wait(ctx, time.Minute, "stream "+name+" led, its replicas current", func() bool {
			actx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			s, err := js.Stream(actx, name)
			if err != nil {
				return false
			}
			ci := s.CachedInfo().Cluster
			if ci == nil || ci.Leader == "" || len(ci.Replicas) != e.replicas()-1 {
				return false
			}
			for _, r := range ci.Replicas {
				if !r.Current {
					return false
				}
			}
			return true
		})
		if err != nil {
			return err
		}
	}
	return nil
}
