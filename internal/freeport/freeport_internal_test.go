package freeport

import (
	"net"
	"strconv"
	"testing"
)

// The port Loopback returns lies below the kernel's ephemeral range,
// where no outgoing connection and no listener on port 0 can take it
// between the check and the caller binding it, and it is free when chosen.
func TestLoopbackIsBelowTheEphemeralRange(t *testing.T) {
	low := ephemeralLow()
	for range 50 {
		port, err := Loopback()
		if err != nil {
			t.Fatal(err)
		}
		if port < 10000 || port >= low {
			t.Fatalf("port %d: want one from 10000 to %d, below the ephemeral range", port, low-1)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			t.Fatalf("port %d was chosen as free, and does not bind: %v", port, err)
		}
		l.Close()
	}
}
