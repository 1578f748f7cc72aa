package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// postgres is a throwaway PostgreSQL server, started the way leasehold's
// testing/pgtest starts one (initdb in a temporary directory, as the
// postgres user under root since initdb refuses root, on a free loopback
// port), but durable: fsync, synchronous_commit and full_page_writes keep
// PostgreSQL's defaults, so that every commit is on disk before it is
// acknowledged.
type postgres struct {
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{}
}

func startPostgres(ctx context.Context) (*postgres, error) {
	bin, err := postgresBinaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "riverbench-pg-")
	if err != nil {
		return nil, err
	}
	pg := &postgres{dir: dir}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("running as root, and initdb refuses root: create a postgres user (Debian's postgresql package does): %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	pg.port = l.Addr().(*net.TCPAddr).Port
	l.Close()
	logf, err := os.Create(filepath.Join(dir, "postgres.log"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer logf.Close()
	pg.cmd = exec.Command(filepath.Join(bin, "postgres"), "-D", data, "-p", strconv.Itoa(pg.port), "-k", dir,
		"-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200", "-c", "shared_buffers=128MB")
	pg.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Setpgid: true, Pdeathsig: syscall.SIGKILL}
	pg.cmd.Stdout, pg.cmd.Stderr = logf, logf
	if err := pg.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	pg.done = make(chan struct{})
	go func() { _ = pg.cmd.Wait(); close(pg.done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		conn, err := pgx.Connect(ctx, pg.url())
		if err == nil {
			conn.Close(ctx)
			return pg, nil
		}
		select {
		case <-pg.done:
			pg.stop()
			return nil, fmt.Errorf("postgres exited: see %s", filepath.Join(dir, "postgres.log"))
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			pg.stop()
			return nil, fmt.Errorf("postgres did not accept connections within 30s: %w", err)
		}
	}
}

func (pg *postgres) url() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", pg.port)
}

// pids are the server's processes: the postmaster and its children (one
// backend per connection, and the background workers).
func (pg *postgres) pids() []int {
	if pg == nil {
		return nil
	}
	return append([]int{pg.cmd.Process.Pid}, childrenOf(pg.cmd.Process.Pid)...)
}

func (pg *postgres) stop() {
	_ = pg.cmd.Process.Signal(syscall.SIGINT) // fast shutdown
	select {
	case <-pg.done:
	case <-time.After(10 * time.Second):
		_ = pg.cmd.Process.Kill()
		<-pg.done
	}
	os.RemoveAll(pg.dir)
}

func postgresBinaries() (string, error) {
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
	sort.Slice(dirs, func(i, j int) bool {
		a, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		b, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return a > b
	})
	for _, d := range dirs {
		_, e1 := os.Stat(filepath.Join(d, "initdb"))
		_, e2 := os.Stat(filepath.Join(d, "postgres"))
		if e1 == nil && e2 == nil {
			return d, nil
		}
	}
	return "", errors.New("initdb and postgres were not found on PATH or under /usr/lib/postgresql/*/bin: install Debian's postgresql package, or pass --postgres-url")
}
