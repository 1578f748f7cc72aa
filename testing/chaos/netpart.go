package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// netPartition puts one worker in a network namespace of its own, joined
// to the harness by a veth pair, and cuts and heals its traffic with
// nftables rules inside the namespace. The worker reaches NATS through
// TCP proxies the harness runs on the host end of the pair, since the
// servers listen on loopback only. Everything it creates is removed by
// close, also after a failed setup; deleting the namespace removes the
// veth pair and the rules with it.
type netPartition struct {
	ns, hostIf string
	hostIP     string
	proxies    []*proxy
	cut        bool
}

// errNoPartition reports why a network partition cannot run here.
type errNoPartition struct{ reason string }

func (e *errNoPartition) Error() string { return "network partition skipped: " + e.reason }

// netPartitionAvailable says why partitions cannot run, or returns nil.
func netPartitionAvailable() error {
	if os.Geteuid() != 0 {
		return &errNoPartition{"not running as root (network namespaces and nftables need it)"}
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			return &errNoPartition{tool + " is not installed (Debian: apt-get install iproute2 nftables)"}
		}
	}
	return nil
}

const nftTable = "leasehold_chaos"

// setupNetPartition creates the namespace and the proxies to targets
// (host:port addresses on this machine).
func setupNetPartition(targets []string) (_ *netPartition, err error) {
	if err := netPartitionAvailable(); err != nil {
		return nil, err
	}
	// Link-local addresses: they are on no network but this veth pair.
	tag := os.Getpid()%9000 + rand.IntN(1000)
	n := &netPartition{
		ns:     fmt.Sprintf("lhchaos-%d", tag),
		hostIf: fmt.Sprintf("lhc%dh", tag),
	}
	nsIf := fmt.Sprintf("lhc%dn", tag)
	// One /30 of 169.254.0.0/16 per tag, so that runs side by side do not
	// share addresses.
	block := tag % 16000
	n.hostIP = fmt.Sprintf("169.254.%d.%d", 1+block/64, block%64*4+1)
	nsIP := fmt.Sprintf("169.254.%d.%d", 1+block/64, block%64*4+2)
	defer func() {
		if err != nil {
			n.close()
		}
	}()
	steps := [][]string{
		{"ip", "netns", "add", n.ns},
		{"ip", "link", "add", n.hostIf, "type", "veth", "peer", "name", nsIf},
		{"ip", "link", "set", nsIf, "netns", n.ns},
		{"ip", "addr", "add", n.hostIP + "/30", "dev", n.hostIf},
		{"ip", "link", "set", n.hostIf, "up"},
		{"ip", "netns", "exec", n.ns, "ip", "addr", "add", nsIP + "/30", "dev", nsIf},
		{"ip", "netns", "exec", n.ns, "ip", "link", "set", nsIf, "up"},
		{"ip", "netns", "exec", n.ns, "ip", "link", "set", "lo", "up"},
		{"ip", "netns", "exec", n.ns, "nft", "add", "table", "inet", nftTable},
		{"ip", "netns", "exec", n.ns, "nft", "add chain inet " + nftTable + " in { type filter hook input priority 0; policy accept; }"},
		{"ip", "netns", "exec", n.ns, "nft", "add chain inet " + nftTable + " out { type filter hook output priority 0; policy accept; }"},
	}
	for _, s := range steps {
		if err := runTool(s...); err != nil {
			return nil, &errNoPartition{err.Error()}
		}
	}
	for _, t := range targets {
		p, err := startProxy(n.hostIP+":0", t)
		if err != nil {
			return nil, err
		}
		n.proxies = append(n.proxies, p)
	}
	return n, nil
}

func runTool(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// urls are the NATS URLs a worker in the namespace connects to.
func (n *netPartition) urls() string {
	var u []string
	for _, p := range n.proxies {
		u = append(u, "nats://"+p.addr())
	}
	return strings.Join(u, ",")
}

// wrap returns the command line that runs bin args in the namespace.
// `ip netns exec` execs the command, so signals reach it directly.
func (n *netPartition) wrap(bin string, args []string) (string, []string) {
	ip, _ := exec.LookPath("ip")
	return ip, append([]string{"netns", "exec", n.ns, bin}, args...)
}

// cutOff drops every packet in and out of the namespace.
func (n *netPartition) cutOff() error {
	for _, chain := range []string{"in", "out"} {
		if err := runTool("ip", "netns", "exec", n.ns, "nft", "add", "rule", "inet", nftTable, chain, "drop"); err != nil {
			return err
		}
	}
	n.cut = true
	return nil
}

// heal removes the drop rules.
func (n *netPartition) heal() error {
	if !n.cut {
		return nil
	}
	for _, chain := range []string{"in", "out"} {
		if err := runTool("ip", "netns", "exec", n.ns, "nft", "flush", "chain", "inet", nftTable, chain); err != nil {
			return err
		}
	}
	n.cut = false
	return nil
}

// close removes the namespace (with its veth end and rules) and the host
// end, and stops the proxies. It reports what it could not remove.
func (n *netPartition) close() error {
	for _, p := range n.proxies {
		p.close()
	}
	var errs []error
	if err := runTool("ip", "netns", "del", n.ns); err != nil && !strings.Contains(err.Error(), "No such file") {
		errs = append(errs, err)
	}
	// Deleting the namespace deletes the pair; this covers a setup that
	// failed before the peer moved into it.
	if _, err := net.InterfaceByName(n.hostIf); err == nil {
		if err := runTool("ip", "link", "del", n.hostIf); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// proxy forwards TCP connections from a listening address to a target.
type proxy struct {
	ln     net.Listener
	target string
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
}

func startProxy(listen, target string) (*proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("chaos: proxy on %s: %w", listen, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &proxy{ln: ln, target: target, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *proxy) track(c net.Conn, add bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		if p.ctx.Err() != nil {
			return false
		}
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
	return true
}

func (p *proxy) serve(c net.Conn) {
	defer p.wg.Done()
	d := net.Dialer{Timeout: 2 * time.Second}
	up, err := d.DialContext(p.ctx, "tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	if !p.track(c, true) || !p.track(up, true) {
		c.Close()
		up.Close()
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	<-done
	<-done
	p.track(c, false)
	p.track(up, false)
}

func (p *proxy) close() {
	p.mu.Lock()
	p.cancel()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}
