package natstest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/embedded"
)

// Cluster is a JetStream cluster of three servers in this process, on
// loopback ports that stay the same across node restarts.
type Cluster struct {
	tb    testing.TB
	nodes []*Server
}

// ClusterSize is the number of nodes StartCluster starts.
const ClusterSize = 3

// StartCluster starts a three-node JetStream cluster and waits until it has
// a meta leader. It stops when the test ends. The Listen option is implied.
func StartCluster(tb testing.TB, opts ...Option) *Cluster {
	tb.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	ports, err := embedded.FreePorts("127.0.0.1", 2*ClusterSize)
	if err != nil {
		tb.Fatal(err)
	}
	var routes []string
	for i := range ClusterSize {
		routes = append(routes, embedded.Addr("127.0.0.1", ports[ClusterSize+i]))
	}
	c := &Cluster{tb: tb}
	for i := range ClusterSize {
		cfg := embedded.Config{
			Name:         "natstest-" + string(rune('a'+i)),
			StoreDir:     tb.TempDir(),
			Listen:       true,
			Port:         ports[i],
			SyncAlways:   o.syncAlways,
			Tweak:        o.tweak,
			Cluster:      &embedded.ClusterConfig{Name: "natstest", Port: ports[ClusterSize+i], Routes: routes},
			ReadyTimeout: readyTimeout,
		}
		c.nodes = append(c.nodes, &Server{tb: tb, cfg: cfg})
	}
	// Start the nodes together: each waits for routes to the others only
	// until it is ready for clients, which does not need the others.
	for _, n := range c.nodes {
		n.start()
		tb.Cleanup(n.Shutdown)
	}
	nc := c.Connect(tb)
	js := newJetStream(tb, nc)
	WaitJetStream(tb, js, 30*time.Second)
	waitPlacement(tb, js, 30*time.Second)
	return c
}

// waitPlacement waits until the cluster places a stream of three replicas.
// The meta leader places one on a node only once it has had that node's
// statistics, which a node sends some time after it joined: before then,
// on a busy machine, a test's first bucket of three replicas was refused
// with "no suitable peers for placement, peer offline". A stream in memory
// is made and removed.
func waitPlacement(tb testing.TB, js jetstream.JetStream, timeout time.Duration) {
	tb.Helper()
	const probe = "natstest_placement"
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: probe, Subjects: []string{"natstest.placement"}, Replicas: ClusterSize, Storage: jetstream.MemoryStorage})
		if err == nil {
			err = js.DeleteStream(ctx, probe)
			cancel()
			if err != nil {
				fatalf(tb, "natstest: remove the placement probe: %v", err)
			}
			return
		}
		cancel()
		if time.Now().After(deadline) {
			fatalf(tb, "natstest: the cluster places no stream of %d replicas after %v: %v", ClusterSize, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Node returns node i (0, 1 or 2).
func (c *Cluster) Node(i int) *Server { return c.nodes[i] }

// URLs is the comma-separated list of the nodes' client URLs.
func (c *Cluster) URLs() string {
	var urls []string
	for _, n := range c.nodes {
		urls = append(urls, n.URL())
	}
	return strings.Join(urls, ",")
}

// Connect opens a client connection that knows every node and reconnects to
// whichever is up. It is closed when the test ends.
func (c *Cluster) Connect(tb testing.TB, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	nc, err := nats.Connect(c.URLs(), append(reconnectOpts(), opts...)...)
	if err != nil {
		tb.Fatalf("natstest: connect to cluster: %v", err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// JetStream connects and returns a JetStream context.
func (c *Cluster) JetStream(tb testing.TB, opts ...nats.Option) jetstream.JetStream {
	tb.Helper()
	return newJetStream(tb, c.Connect(tb, opts...))
}

// Kill stops node i at once.
func (c *Cluster) Kill(i int) { c.nodes[i].Shutdown() }

// Restart starts node i again on its store and ports.
func (c *Cluster) Restart(tb testing.TB, i int) {
	tb.Helper()
	c.nodes[i].Shutdown()
	c.nodes[i].start()
}

// StreamLeader returns the index of the node that leads stream (in the
// global account), waiting up to timeout for an election.
func (c *Cluster) StreamLeader(tb testing.TB, stream string, timeout time.Duration) int {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		for i, n := range c.nodes {
			if n.Running() && n.NATS().JetStreamIsStreamLeader("$G", stream) {
				return i
			}
		}
		if time.Now().After(deadline) {
			fatalf(tb, "natstest: stream %s has no leader after %v", stream, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitStreamCurrent waits until every running node has caught up on stream.
func (c *Cluster) WaitStreamCurrent(tb testing.TB, stream string, timeout time.Duration) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		ok := true
		for _, n := range c.nodes {
			if n.Running() && !n.NATS().JetStreamIsStreamCurrent("$G", stream) {
				ok = false
			}
		}
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			fatalf(tb, "natstest: stream %s not current on every node after %v", stream, timeout)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
