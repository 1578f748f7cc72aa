// Package pgtest starts a throwaway PostgreSQL server for tests: initdb in
// a temporary directory, postgres on a free loopback port, stopped and
// removed when the test ends. It needs Debian's postgresql package (or any
// installation with initdb and postgres on PATH or under
// /usr/lib/postgresql/*/bin); without it tests skip, unless the environment
// variable LEASEHOLD_REQUIRE_POSTGRES=1 makes them fail.
//
// initdb refuses to run as root, so under root the server runs as the
// postgres system user, in a directory owned by that user.
//
// Import it from tests only.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/internal/freeport"
	"github.com/leasehold/leasehold/internal/testskip"
)

// RequireEnv names the environment variable that turns a missing
// PostgreSQL installation from a skip into a failure.
const RequireEnv = "LEASEHOLD_REQUIRE_POSTGRES"

// Option configures a server.
type Option func(*options)

type options struct {
	durable bool
}

// Durable keeps fsync and synchronous commit on. By default they are off:
// tests restart the server with a clean shutdown, which loses nothing, and
// run far faster without waiting for the disk.
func Durable() Option { return func(o *options) { o.durable = true } }

// Server is one PostgreSQL server. Its data directory survives Stop and
// Start.
type Server struct {
	tb   testing.TB
	bin  string
	dir  string // owned by the server's user: data/ and sock/ inside
	port int
	cred *syscall.Credential
	opts options

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
}

// Start initialises a database cluster and starts a server on it. The
// server stops, and its directory is removed, when the test ends.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	bin, err := findBinaries()
	if err != nil {
		if os.Getenv(RequireEnv) == "1" {
			tb.Fatalf("pgtest: %v (%s=1 requires PostgreSQL)", err, RequireEnv)
		}
		testskip.Skip(tb, testskip.PostgreSQL, fmt.Sprintf("pgtest: %v: install Debian's postgresql package (apt-get install postgresql) to run this test", err))
	}
	s := &Server{tb: tb, bin: bin}
	for _, o := range opts {
		o(&s.opts)
	}
	if err := s.init(); err != nil {
		if s.dir != "" {
			os.RemoveAll(s.dir)
		}
		tb.Fatalf("pgtest: %v", err)
	}
	tb.Cleanup(func() {
		s.Stop()
		os.RemoveAll(s.dir)
	})
	s.Start(tb)
	return s
}

func findBinaries() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		_, e1 := os.Stat(filepath.Join(d, "initdb"))
		_, e2 := os.Stat(filepath.Join(d, "postgres"))
		if e1 == nil && e2 == nil {
			return d, nil
		}
	}
	return "", errors.New("initdb and postgres were not found on PATH or under /usr/lib/postgresql/*/bin")
}

func version(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func (s *Server) init() error {
	dir, err := os.MkdirTemp("", "pgtest-")
	if err != nil {
		return err
	}
	s.dir = dir
	for _, sub := range []string{"data", "sock"} {
		if err := os.Mkdir(filepath.Join(dir, sub), 0o700); err != nil {
			return err
		}
	}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return fmt.Errorf("running as root, and initdb refuses root: create a postgres user (Debian's postgresql package does): %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		for _, p := range []string{dir, filepath.Join(dir, "data"), filepath.Join(dir, "sock")} {
			if err := os.Chown(p, uid, gid); err != nil {
				return err
			}
		}
	}
	port, err := freeport.Loopback()
	if err != nil {
		return err
	}
	s.port = port
	// A copy of a cluster initdb made once is the same cluster, in a
	// third of the time and a tenth of the CPU; without a cache, initdb.
	if tpl, err := templateCluster(s.bin, s.cred); err == nil {
		if err := copyTree(tpl, filepath.Join(dir, "data"), s.cred); err == nil {
			return nil
		}
		if err := os.RemoveAll(filepath.Join(dir, "data")); err != nil {
			return err
		}
		if err := os.Mkdir(filepath.Join(dir, "data"), 0o700); err != nil {
			return err
		}
		if s.cred != nil {
			if err := os.Chown(filepath.Join(dir, "data"), int(s.cred.Uid), int(s.cred.Gid)); err != nil {
				return err
			}
		}
	}
	return initdb(s.bin, dir, s.cred)
}

// initdbArgs are the arguments of every cluster pgtest makes, after -D.
var initdbArgs = []string{"-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"}

// initdb makes a cluster in dir/data, which exists, as cred's user.
func initdb(bin, dir string, cred *syscall.Credential) error {
	cmd := exec.Command(filepath.Join(bin, "initdb"), append([]string{"-D", filepath.Join(dir, "data")}, initdbArgs...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w\n%s", err, out)
	}
	return nil
}

// Start starts the server on its data directory if it is not running, and
// waits until it accepts connections.
func (s *Server) Start(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return
	}
	args := []string{"-D", filepath.Join(s.dir, "data"), "-p", strconv.Itoa(s.port),
		"-k", filepath.Join(s.dir, "sock"), "-c", "listen_addresses=127.0.0.1",
		"-c", "max_connections=200", "-c", "shared_buffers=64MB"}
	if !s.opts.durable {
		args = append(args, "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	}
	logf, err := os.OpenFile(filepath.Join(s.dir, "postgres.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(s.bin, "postgres"), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Setpgid: true}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = s.dir
	if err := cmd.Start(); err != nil {
		tb.Fatalf("pgtest: start postgres: %v", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	s.cmd, s.done = cmd, done
	if err := s.waitReady(done); err != nil {
		tb.Fatalf("pgtest: %v\n%s", err, s.logTail())
	}
}

// waitReady polls until a connection succeeds: the server tells readiness
// only through its log or a connection.
func (s *Server) waitReady(done chan struct{}) error {
	deadline := time.Now().Add(60 * time.Second)
	var err error
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return errors.New("postgres exited during start-up")
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		var c *pgx.Conn
		c, err = pgx.Connect(ctx, s.DSN())
		if err == nil {
			err = c.Ping(ctx)
			c.Close(ctx)
		}
		cancel()
		if err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("postgres did not accept connections within a minute: %w", err)
}

// Stop shuts the server down (a fast shutdown: sessions are ended, and
// everything committed is on disk) and waits for it. It is safe to call
// when the server is not running.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.done:
	case <-time.After(60 * time.Second):
		_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
	}
	s.cmd, s.done = nil, nil
}

// Restart stops the server and starts it again on the same data and port.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Stop()
	s.Start(tb)
}

// Running reports whether the server process is up.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil
}

// Port is the server's TCP port on 127.0.0.1.
func (s *Server) Port() int { return s.port }

// DSN is the connection string of the postgres database as the postgres
// superuser.
func (s *Server) DSN() string { return s.DatabaseDSN("postgres") }

// DatabaseDSN is the connection string of database name.
func (s *Server) DatabaseDSN(name string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.port, name)
}

// CreateDatabase creates a database and returns its connection string.
func (s *Server) CreateDatabase(tb testing.TB, name string) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, s.DSN())
	if err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("pgtest: create database %s: %v", name, err)
	}
	return s.DatabaseDSN(name)
}

func (s *Server) logTail() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "postgres.log"))
	lines := strings.Split(string(b), "\n")
	if len(lines) > 30 {
		lines = lines[len(lines)-30:]
	}
	return strings.Join(lines, "\n")
}
