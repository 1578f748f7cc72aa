package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// Deleting a partition's job consumer under the worker (nats consumer rm)
// while jobs are in flight, with idle heartbeats and without, loses and
// repeats nothing: the fetcher makes a new consumer at the job it needs
// next, and the handler sees every job once, in order.
func TestJobConsumerDeletedUnderTheWorker(t *testing.T) {
	t.Parallel()
	for _, wait := range []time.Duration{200 * time.Millisecond, time.Second, 5 * time.Second} {
		t.Run(wait.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			const total = 400
			e.enqueue(t, 0, total)
			var runs runLog
			rec := newRecorder()
			js := e.js
			cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
				runs.add(j)
				if j.Seq%37 == 0 {
					dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					defer cancel()
					s, err := js.Stream(dctx, worker.JobsStream(e.prefix))
					if err != nil {
						return err
					}
					names := s.ConsumerNames(dctx)
					for n := range names.Name() {
						_ = s.DeleteConsumer(dctx, n)
					}
				}
				return nil
			}))
			cfg.Observer = rec
			cfg.FetchWait = wait
			cfg.FetchBatch = 10
			cfg.Order = worker.OrderPartition // the runs' order is asserted
			start(t, cfg)
			rec.waitFor(t, 60*time.Second, "all jobs to run", func() bool { return runs.n.Load() >= total })
			for i, r := range runs.all() {
				if r.Seq != uint64(i+1) || r.Attempt != 1 {
					t.Fatalf("run %d was job %d attempt %d, want job %d attempt 1", i, r.Seq, r.Attempt, i+1)
				}
			}
			if got := runs.n.Load(); got != total {
				t.Errorf("%d runs, want %d", got, total)
			}
		})
	}
}
