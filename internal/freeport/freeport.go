// Package freeport finds a loopback port for a server that binds it only
// later, such as a PostgreSQL started for tests or benchmarks.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// Loopback returns a port on 127.0.0.1 that nothing listens on, below the
// kernel's range of ephemeral ports. The caller's server binds it only
// later: a port the kernel hands out (Listen on port 0) may meanwhile
// become the local port of any outgoing connection, or of another
// listener on port 0, and a busy test run makes thousands of those
// ("could not bind IPv4 address: Address already in use"). Below that
// range only a program that names its port takes one.
func Loopback() (int, error) {
	low, high := 10000, ephemeralLow()
	var err error
	for range 100 {
		port := low + rand.IntN(high-low)
		var l net.Listener
		l, err = net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			l.Close()
			return port, nil
		}
	}
	return 0, fmt.Errorf("find a free port from %d to %d: %w", low, high-1, err)
}

// ephemeralLow is the lowest port of the kernel's ephemeral range (Linux's
// default when it cannot be read, or when it leaves too little below it).
func ephemeralLow() int {
	const linuxDefault = 32768
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return linuxDefault
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return linuxDefault
	}
	n, err := strconv.Atoi(f[0])
	if err != nil || n < 20000 {
		return linuxDefault
	}
	return n
}
