// Package embedded starts nats-server inside the calling process with
// JetStream enabled. The demo command and the natstest kit share it; it has
// no dependency on package testing, so binaries that embed a server for a
// demo do not link test machinery.
package embedded

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Config describes one embedded server.
type Config struct {
	Name       string // server name; required in a cluster
	StoreDir   string // JetStream store directory; required
	Listen     bool   // accept TCP clients on Host:Port
	Host       string // default 127.0.0.1
	Port       int    // 0 picks a free port
	SyncAlways bool   // fsync every write before acknowledging it

	// Cluster, when set, joins the server to a cluster on loopback.
	Cluster *ClusterConfig

	// Tweak, when set, adjusts the options last (authentication, TLS,
	// limits).
	Tweak func(*server.Options)

	ReadyTimeout time.Duration // default 10s
}

// ClusterConfig places a server in a cluster.
type ClusterConfig struct {
	Name   string
	Port   int      // this node's route port
	Routes []string // every node's route address host:port, this one included
}

// Start starts a server and waits until it accepts connections.
func Start(cfg Config) (*server.Server, error) {
	if cfg.StoreDir == "" {
		return nil, errors.New("embedded: StoreDir is required")
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.ReadyTimeout == 0 {
		cfg.ReadyTimeout = 10 * time.Second
	}
	opts := &server.Options{
		ServerName: cfg.Name,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		SyncAlways: cfg.SyncAlways,
		NoSigs:     true,
		NoLog:      true,
		// Embedded servers are for demos and tests: cap what they may take so
		// a parallel test run does not trip over the host's memory.
		JetStreamMaxMemory: 256 << 20,
		JetStreamMaxStore:  4 << 30,
		DontListen:         !cfg.Listen,
		Host:               cfg.Host,
		Port:               cfg.Port,
	}
	if cfg.Listen && cfg.Port == 0 {
		opts.Port = server.RANDOM_PORT
	}
	if c := cfg.Cluster; c != nil {
		if cfg.Name == "" {
			return nil, errors.New("embedded: a cluster node needs a Name")
		}
		opts.Cluster = server.ClusterOpts{Name: c.Name, Host: cfg.Host, Port: c.Port}
		var routes []*url.URL
		for _, r := range c.Routes {
			routes = append(routes, &url.URL{Scheme: "nats", Host: r})
		}
		opts.Routes = routes
	}
	if cfg.Tweak != nil {
		cfg.Tweak(opts)
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded: configure nats-server: %w", err)
	}
	go s.Start()
	if !s.ReadyForConnections(cfg.ReadyTimeout) {
		s.Shutdown()
		s.WaitForShutdown()
		return nil, fmt.Errorf("embedded: nats-server did not become ready within %v", cfg.ReadyTimeout)
	}
	return s, nil
}

// FreePorts returns n TCP ports on host that were free a moment ago.
func FreePorts(host string, n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return nil, fmt.Errorf("embedded: find a free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Addr joins host and port.
func Addr(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }
