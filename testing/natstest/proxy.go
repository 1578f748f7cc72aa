package natstest

import (
	"bytes"
	"net"
	"strings"
	"sync"
	"testing"
)

// Proxy forwards TCP connections to a server and can freeze them: bytes
// stop flowing both ways without any connection closing, which is how a
// paused process or a silent network partition looks from the other side.
// Clients connected through it see neither an error nor a disconnect; their
// requests just time out. It closes when the test ends.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	cond    *sync.Cond
	frozen  bool
	closed  bool
	holding int           // reads held by a freeze
	sent    int           // of those, reads from a client (bytes it sent the server)
	gen     int           // bumped by Cut: pipes of an earlier generation drop what they hold
	cutAt   []byte        // CutAt's pattern, until a client sends it
	cutDone chan struct{} // closed when it did
	conns   []net.Conn
	wg      sync.WaitGroup
}

// NewProxy starts a proxy on a loopback port in front of url (a nats://
// URL or host:port).
func NewProxy(tb testing.TB, url string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &Proxy{ln: ln, target: strings.TrimPrefix(url, "nats://")}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	tb.Cleanup(p.Close)
	return p
}

// URL is the proxy's client URL.
func (p *Proxy) URL() string { return "nats://" + p.ln.Addr().String() }

// Freeze holds every byte read from now on, in both directions.
func (p *Proxy) Freeze() { p.set(true) }

// Thaw lets the held bytes, and everything after them, through.
func (p *Proxy) Thaw() { p.set(false) }

// Holding reports how many reads a freeze holds back: a test that froze
// the proxy waits for it to be above zero to know that what its client
// sent is held, not still on its way.
func (p *Proxy) Holding() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.holding
}

// HoldingSent reports how many reads from clients a freeze holds back: a
// test that froze the proxy waits for it to be above zero to know that a
// request its client sent has not reached the server.
func (p *Proxy) HoldingSent() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sent
}

// Cut closes every connection open through the proxy and drops what a
// freeze holds of them, as a network that loses the connection with bytes
// in flight: their clients see the connection drop, and what they sent
// last never reaches the server. New connections are taken as before
// (and are held while the proxy stays frozen).
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.gen++
	conns := p.conns
	p.conns = nil
	p.cond.Broadcast()
	p.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// CutAt arms a cut at a request: the next read from a client that holds
// pattern is dropped and every connection is cut, as a network that loses
// the connection with that request on it. The request never reaches the
// server, and its client, reconnected, never gets an answer. The channel
// closes when it happened.
func (p *Proxy) CutAt(pattern string) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cutAt = []byte(pattern)
	p.cutDone = make(chan struct{})
	return p.cutDone
}

func (p *Proxy) set(frozen bool) {
	p.mu.Lock()
	p.frozen = frozen
	p.cond.Broadcast()
	p.mu.Unlock()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			s.Close()
			return
		}
		p.conns = append(p.conns, c, s)
		gen := p.gen
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(c, s, false, gen)
		go p.pipe(s, c, true, gen)
	}
}

// pipe copies src to dst, holding what it read while frozen; fromClient
// says src is the client's side. A Cut after gen drops what it holds.
func (p *Proxy) pipe(dst, src net.Conn, fromClient bool, gen int) {
	defer p.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if p.frozen && !p.closed && p.gen == gen {
				p.holding++
				if fromClient {
					p.sent++
				}
				for p.frozen && !p.closed && p.gen == gen {
					p.cond.Wait()
				}
				p.holding--
				if fromClient {
					p.sent--
				}
			}
			cut := p.gen != gen
			at := fromClient && !cut && p.cutAt != nil && bytes.Contains(buf[:n], p.cutAt)
			if at {
				p.cutAt = nil
				close(p.cutDone)
			}
			p.mu.Unlock()
			if at {
				p.Cut()
				return
			}
			if cut {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Close closes every connection and stops the proxy. It is safe to call
// twice.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	p.ln.Close()
	for _, c := range conns {
		c.Close()
	}
	p.wg.Wait()
}
