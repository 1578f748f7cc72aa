// Command riverbench runs River (github.com/riverqueue/river) on
// PostgreSQL with jobs whose worker waits 50 ms on a timer, in one or more
// processes, and prints the jobs per second they reach: the peer of
// `leasehold bench --only io`. It lives in a module of its own so that no
// build of leasehold pulls River in. See README.md.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

func main() {
	var (
		url        = flag.String("postgres-url", "", "PostgreSQL database to run on (default: start a throwaway server with PostgreSQL's durable defaults, fsync on)")
		procs      = flag.String("procs", "1,2", "worker process counts to measure, comma-separated")
		maxWorkers = flag.String("max-workers", "100,64", "River MaxWorkers of each worker process, comma-separated")
		jobs       = flag.Int("jobs", 0, "jobs a run (default: enough for 3 s at the rate the workers allow, at least 400)")
		runs       = flag.Int("runs", 3, "runs of each configuration; the table shows their median")
		work       = flag.Duration("work", 50*time.Millisecond, "how long each job's worker waits")
		effect     = flag.Bool("effect", false, "each job writes one row and completes in the same transaction (JobCompleteTx)")
		cooldown   = flag.Duration("fetch-cooldown", 0, "River's FetchCooldown, the least time between two fetches of one client (default River's, 100ms; at least 1ms)")
		child      = flag.Bool("child", false, "run one worker process (riverbench starts these itself)")
	)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if *child {
		n, _ := strconv.Atoi(*maxWorkers)
		err = runChild(ctx, *url, n, *work, *effect, *cooldown)
	} else {
		err = run(ctx, config{url: *url, procs: ints(*procs), maxWorkers: ints(*maxWorkers), jobs: *jobs, runs: *runs, work: *work, effect: *effect, cooldown: *cooldown})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "riverbench:", err)
		os.Exit(1)
	}
}

type config struct {
	url        string
	procs      []int
	maxWorkers []int
	jobs, runs int
	work       time.Duration
	effect     bool
	cooldown   time.Duration
}

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "riverbench: %q: want positive whole numbers, comma-separated\n", s)
			os.Exit(2)
		}
		out = append(out, n)
	}
	return out
}

func run(ctx context.Context, cfg config) error {
	if len(cfg.procs) == 0 || len(cfg.maxWorkers) == 0 || cfg.runs < 1 {
		return errors.New("nothing to measure")
	}
	var pg *postgres
	if cfg.url == "" {
		var err error
		if pg, err = startPostgres(ctx); err != nil {
			return err
		}
		defer pg.stop()
		cfg.url = pg.url()
	}
	pool, err := pgxpool.New(ctx, cfg.url)
	if err != nil {
		return err
	}
	defer pool.Close()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrate River's schema: %w", err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS bench_effect (job_id bigint PRIMARY KEY, n int NOT NULL)"); err != nil {
		return err
	}
	// An insert-only client: no queues, no workers.
	inserter, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	if err != nil {
		return err
	}
	var sync string
	_ = pool.QueryRow(ctx, "SELECT current_setting('fsync') || ', synchronous_commit ' || current_setting('synchronous_commit')").Scan(&sync)
	cooldown := "River's default FetchCooldown (100ms)"
	if cfg.cooldown > 0 {
		cooldown = fmt.Sprintf("FetchCooldown %v", cfg.cooldown)
	}
	fmt.Printf("River v0.51.2 (riverpgxv5, pgx v5.12.0) on PostgreSQL (fsync %s); jobs wait %v%s; %s; median of %d runs\n\n",
		sync, cfg.work, map[bool]string{true: " and write one row with JobCompleteTx"}[cfg.effect], cooldown, cfg.runs)
	fmt.Printf("%-6s %-12s %-10s %-8s %-10s %-10s %-16s %-16s %s\n", "PROCS", "MAX_WORKERS", "IN_FLIGHT", "JOBS", "JOBS/S", "CEILING", "WORKER_µs_CPU/J", "PG_µs_CPU/JOB", "RUNS (jobs/s)")
	for _, mw := range cfg.maxWorkers {
		for _, np := range cfg.procs {
			if err := measure(ctx, cfg, pool, inserter, pg, np, mw); err != nil {
				return err
			}
		}
	}
	return nil
}

// fleet is the worker processes of one configuration.
type fleet struct {
	cmds  []*exec.Cmd
	stdin []interface{ Close() error }
	mu    sync.Mutex
	done  []int // jobs completed, by process
	ready int
	kick  chan struct{}
	exits chan error
}

func startFleet(cfg config, np, mw int) (*fleet, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	f := &fleet{done: make([]int, np), kick: make(chan struct{}, 1), exits: make(chan error, np)}
	for i := range np {
		cmd := exec.Command(self, "-child", "-postgres-url", cfg.url, "-max-workers", strconv.Itoa(mw), "-work", cfg.work.String(), "-effect="+strconv.FormatBool(cfg.effect), "-fetch-cooldown", cfg.cooldown.String())
		cmd.Stderr = os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		in, err := cmd.StdinPipe()
		if err != nil {
			f.stop()
			return nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			f.stop()
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			f.stop()
			return nil, err
		}
		f.cmds, f.stdin = append(f.cmds, cmd), append(f.stdin, in)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				f.mu.Lock()
				if sc.Text() == "ready" {
					f.ready++
				} else if n, err := strconv.Atoi(sc.Text()); err == nil {
					f.done[i] = n
				}
				f.mu.Unlock()
				select {
				case f.kick <- struct{}{}:
				default:
				}
			}
			f.exits <- cmd.Wait()
		}()
	}
	return f, nil
}

func (f *fleet) pids() []int {
	var out []int
	for _, c := range f.cmds {
		out = append(out, c.Process.Pid)
	}
	return out
}

func (f *fleet) completed() (n, ready int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.done {
		n += d
	}
	return n, f.ready
}

// waitFor waits until cond holds, a worker process exits, or nothing has
// changed for quiet.
func (f *fleet) waitFor(ctx context.Context, quiet time.Duration, what string, cond func() bool) error {
	t := time.NewTimer(quiet)
	defer t.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-f.exits:
			return fmt.Errorf("%s: a worker process exited: %v", what, err)
		case <-f.kick:
			t.Reset(quiet)
		case <-t.C:
			return fmt.Errorf("%s: nothing happened for %v", what, quiet)
		}
	}
	return nil
}

func (f *fleet) stop() {
	for _, in := range f.stdin {
		_ = in.Close()
	}
	for range f.cmds {
		select {
		case <-f.exits:
		case <-time.After(15 * time.Second):
		}
	}
	for _, c := range f.cmds {
		_ = c.Process.Kill()
	}
}

func measure(ctx context.Context, cfg config, pool *pgxpool.Pool, inserter *river.Client[pgx.Tx], pg *postgres, np, mw int) error {
	if _, err := pool.Exec(ctx, "TRUNCATE river_job, bench_effect"); err != nil {
		return err
	}
	inFlight := np * mw
	ceiling := float64(inFlight) / cfg.work.Seconds()
	n := cfg.jobs
	if n == 0 {
		n = max(400, int(3*ceiling))
	}
	f, err := startFleet(cfg, np, mw)
	if err != nil {
		return err
	}
	defer f.stop()
	if err := f.waitFor(ctx, time.Minute, "start", func() bool { _, r := f.completed(); return r == np }); err != nil {
		return err
	}
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: sleepArgs{N: i}}
	}
	var rates, wcpu, pgcpu []float64
	total := 0
	for range cfg.runs {
		pgPids := pg.pids()
		w0, p0 := cpuOf(f.pids()), cpuOf(pgPids)
		t0 := time.Now()
		if _, err := inserter.InsertManyFast(ctx, params); err != nil {
			return fmt.Errorf("insert: %w", err)
		}
		total += n
		if err := f.waitFor(ctx, time.Minute, "jobs", func() bool { d, _ := f.completed(); return d >= total }); err != nil {
			d, _ := f.completed()
			return fmt.Errorf("%w (%d of %d completed)", err, d, total)
		}
		took := time.Since(t0)
		rates = append(rates, float64(n)/took.Seconds())
		wcpu = append(wcpu, float64((cpuOf(f.pids())-w0).Microseconds())/float64(n))
		pgcpu = append(pgcpu, float64((cpuOf(pgPids)-p0).Microseconds())/float64(n))
	}
	var completed int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE state = 'completed'").Scan(&completed); err != nil {
		return err
	}
	if completed != total {
		return fmt.Errorf("%d jobs completed in the table, %d reported", completed, total)
	}
	pgCol := "-"
	if pg != nil {
		pgCol = fmt.Sprintf("%.0f", median(pgcpu))
	}
	var each []string
	for _, r := range rates {
		each = append(each, fmt.Sprintf("%.0f", r))
	}
	fmt.Printf("%-6d %-12d %-10d %-8d %-10.0f %-10.0f %-16.0f %-16s %s\n", np, mw, inFlight, n, median(rates), ceiling, median(wcpu), pgCol, strings.Join(each, " "))
	return nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
