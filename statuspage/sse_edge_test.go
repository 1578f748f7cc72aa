package statuspage

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// A client that opens the event stream and never reads fills the
// connection's buffers; the handler then blocks in a write that nothing
// ends while the client keeps the connection open, and holds one of the
// maxViewers slots for good: maxViewers such clients lock every operator
// out of the page. A write that cannot go out within a bound ends the
// stream.
func TestEventStreamClientThatNeverReads(t *testing.T) {
	t.Parallel()
	s := New(Config{Prefix: "leasehold"})
	big := strings.Repeat("x", 1000)
	s.mu.Lock()
	for i := range 2000 {
		s.snap.Findings = append(s.snap.Findings, fmt.Sprintf("%d %s", i, big))
	}
	s.mu.Unlock()
	mux := http.NewServeMux()
	s.Register(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()

	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	if _, err := fmt.Fprintf(conn, "GET /status/events HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	viewers := func() int { s.mu.Lock(); defer s.mu.Unlock(); return s.viewers }
	deadline := time.Now().Add(2 * time.Minute)
	for viewers() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the event stream never opened")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Change the state until the handler gives up on the client.
	for viewers() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the event stream of a client that never reads is still open after 2 minutes")
		}
		s.mu.Lock()
		s.notify()
		s.mu.Unlock()
		time.Sleep(50 * time.Millisecond)
	}
}
