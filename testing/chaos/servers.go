package chaos

import (
	"fmt"
	"path/filepath"
	"strings"
	"sync"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/leasehold/leasehold/internal/embedded"
)

// servers is the NATS the run talks to: one server, or a three-node
// cluster, embedded in the harness process on loopback ports that stay
// the same across restarts, so that clients reconnect.
type servers struct {
	mu    sync.Mutex
	cfgs  []embedded.Config
	nodes []*server.Server // nil while a node is down
}

func startServers(dir string, cluster bool) (*servers, error) {
	n := 1
	if cluster {
		n = 3
	}
	ports, err := embedded.FreePorts("127.0.0.1", 2*n)
	if err != nil {
		return nil, err
	}
	var routes []string
	for i := range n {
		routes = append(routes, embedded.Addr("127.0.0.1", ports[n+i]))
	}
	s := &servers{}
	for i := range n {
		cfg := embedded.Config{
			Name:     fmt.Sprintf("chaos-%c", 'a'+i),
			StoreDir: filepath.Join(dir, fmt.Sprintf("nats-%c", 'a'+i)),
			Listen:   true,
			Port:     ports[i],
		}
		if cluster {
			cfg.Cluster = &embedded.ClusterConfig{Name: "chaos", Port: ports[n+i], Routes: routes}
		}
		s.cfgs = append(s.cfgs, cfg)
		s.nodes = append(s.nodes, nil)
	}
	for i := range n {
		if err := s.start(i); err != nil {
			s.shutdown()
			return nil, err
		}
	}
	return s, nil
}

func (s *servers) size() int { return len(s.cfgs) }

// urls is the comma-separated list of client URLs.
func (s *servers) urls() string {
	var u []string
	for _, a := range s.addrs() {
		u = append(u, "nats://"+a)
	}
	return strings.Join(u, ",")
}

// addrs are the nodes' client addresses, host:port.
func (s *servers) addrs() []string {
	var a []string
	for _, c := range s.cfgs {
		a = append(a, embedded.Addr("127.0.0.1", c.Port))
	}
	return a
}

func (s *servers) start(i int) error {
	srv, err := embedded.Start(s.cfgs[i])
	if err != nil {
		return fmt.Errorf("chaos: start NATS node %s: %w", s.cfgs[i].Name, err)
	}
	s.mu.Lock()
	s.nodes[i] = srv
	s.mu.Unlock()
	return nil
}

// stop shuts node i down and waits for it.
func (s *servers) stop(i int) {
	s.mu.Lock()
	srv := s.nodes[i]
	s.nodes[i] = nil
	s.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

func (s *servers) running(i int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nodes[i] != nil
}

func (s *servers) name(i int) string { return s.cfgs[i].Name }

// ensureUp starts every node that is down.
func (s *servers) ensureUp() error {
	for i := range s.cfgs {
		if !s.running(i) {
			if err := s.start(i); err != nil {
				return err
			}
		}
	}
	return nil
}

func (s *servers) shutdown() {
	for i := range s.cfgs {
		s.stop(i)
	}
}

// current reports whether node i is up and has caught up with the
// cluster's metadata.
func (s *servers) current(i int) bool {
	s.mu.Lock()
	srv := s.nodes[i]
	s.mu.Unlock()
	return srv != nil && srv.JetStreamIsCurrent()
}
