package bench

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
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/internal/freeport"
)

// errNoPostgres says PostgreSQL is not installed here.
var errNoPostgres = errors.New("initdb and postgres were not found on PATH or under /usr/lib/postgresql/*/bin (install Debian's postgresql package, or pass a database URL)")

// postgres is a throwaway PostgreSQL server for the fence row, started the
// way testing/pgtest starts one (that package is for tests only): initdb in
// a temporary directory, as the postgres user under root since initdb
// refuses root, on a free loopback port, without fsync.
type postgres struct {
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{}
}

func startPostgres(ctx context.Context, parent string) (*postgres, error) {
	bin, err := postgresBinaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(parent, "pg-")
	if err != nil {
		return nil, err
	}
	pg := &postgres{dir: dir}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root, and initdb refuses root: create a postgres user (Debian's postgresql package does): %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		// The parent directories must be reachable by that user.
		for _, p := range []string{parent, dir} {
			_ = os.Chmod(p, 0o755)
		}
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, err
		}
	}
	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	// Not a port the kernel hands out: it could become another
	// connection's before postgres binds it.
	if pg.port, err = freeport.Loopback(); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "postgres.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	pg.cmd = exec.Command(filepath.Join(bin, "postgres"), "-D", data, "-p", strconv.Itoa(pg.port), "-k", dir,
		"-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	pg.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Setpgid: true, Pdeathsig: syscall.SIGKILL}
	pg.cmd.Stdout, pg.cmd.Stderr = logf, logf
	if err := pg.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	pg.done = make(chan struct{})
	go func() { _ = pg.cmd.Wait(); close(pg.done) }()
	deadline := time.Now().Add(time.Minute)
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err := pgx.Connect(cctx, pg.dsn())
		if err == nil {
			c.Close(cctx)
			cancel()
			return pg, nil
		}
		cancel()
		select {
		case <-pg.done:
			return nil, fmt.Errorf("postgres exited during start-up (see %s)", logf.Name())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			pg.stop()
			return nil, fmt.Errorf("postgres did not accept connections within a minute: %w", err)
		}
	}
}

func (pg *postgres) dsn() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", pg.port)
}

// stop shuts the server down fast and waits for it.
func (pg *postgres) stop() {
	_ = pg.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-pg.done:
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(-pg.cmd.Process.Pid, syscall.SIGKILL)
		<-pg.done
	}
}

func postgresBinaries() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		if _, err := os.Stat(filepath.Join(filepath.Dir(p), "postgres")); err == nil {
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi > vj
	})
	for _, d := range dirs {
		_, e1 := os.Stat(filepath.Join(d, "initdb"))
		_, e2 := os.Stat(filepath.Join(d, "postgres"))
		if e1 == nil && e2 == nil {
			return d, nil
		}
	}
	return "", errNoPostgres
}
