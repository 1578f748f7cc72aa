//go:build unix

package httpsink_test

import (
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
)

// boundPort reserves a loopback port on which nothing listens: a socket
// bound to it, without listen. Connections to it are refused, and no
// other listener, nor an outgoing connection's own port, can take it
// while the test waits (a port found free and closed again can be taken
// by any server that starts meanwhile, and a connection to it then gets
// that server's answer). listen turns the same socket into the
// receiver's listener.
func boundPort(t *testing.T) (addr string, listen func() (net.Listener, error)) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	syscall.CloseOnExec(fd)
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		syscall.Close(fd)
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		syscall.Close(fd)
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "receiver")
	t.Cleanup(func() { f.Close() })
	addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	return addr, func() (net.Listener, error) {
		if err := syscall.Listen(fd, syscall.SOMAXCONN); err != nil {
			return nil, err
		}
		return net.FileListener(f) // a copy of the socket; f's is closed at cleanup
	}
}
