package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

// sleepArgs is the benchmark's job: its worker waits on a timer, as an
// I/O-bound handler waits on the network, and uses no CPU meanwhile.
type sleepArgs struct {
	N int `json:"n"`
}

func (sleepArgs) Kind() string { return "sleep" }

type sleepWorker struct {
	river.WorkerDefaults[sleepArgs]
	work   time.Duration
	effect bool
	pool   *pgxpool.Pool
}

// Work waits, then, with --effect, writes the job's one effect and marks
// the job completed in the same transaction (River's transactional
// completion), the way a River user makes an effect happen once.
func (w *sleepWorker) Work(ctx context.Context, job *river.Job[sleepArgs]) error {
	t := time.NewTimer(w.work)
	select {
	case <-t.C:
	case <-ctx.Done():
		t.Stop()
		return ctx.Err()
	}
	if !w.effect {
		return nil
	}
	return pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO bench_effect (job_id, n) VALUES ($1, $2)", job.ID, job.Args.N); err != nil {
			return err
		}
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		return err
	})
}

// runChild runs one River client with maxWorkers workers until its
// standard input closes. It prints "ready" once started, then the count of
// jobs completed so far (as River reports them: after the completion is
// committed) each time it grows.
func runChild(ctx context.Context, url string, maxWorkers int, work time.Duration, effect bool, cooldown time.Duration) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	workers := river.NewWorkers()
	river.AddWorker(workers, &sleepWorker{work: work, effect: effect, pool: pool})
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues:        map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: maxWorkers}},
		Workers:       workers,
		FetchCooldown: cooldown,
		Logger:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return err
	}
	events, cancel := client.SubscribeConfig(&river.SubscribeConfig{Kinds: []river.EventKind{river.EventKindJobCompleted}, ChanSize: 1 << 20})
	defer cancel()
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		// The parent closes our standard input to stop us.
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()
	if err := client.Start(ctx); err != nil {
		return err
	}
	out := bufio.NewWriter(os.Stdout)
	fmt.Fprintln(out, "ready")
	out.Flush()
	n := 0
	for {
		select {
		case <-ctx.Done():
			sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer scancel()
			return client.Stop(sctx)
		case <-events:
			n++
		}
		// Take what else has arrived, then say how many: one line for
		// many completions.
		for more := true; more; {
			select {
			case <-events:
				n++
			default:
				more = false
			}
		}
		fmt.Fprintln(out, n)
		out.Flush()
	}
}
