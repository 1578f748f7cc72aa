package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A worker whose job connection goes silent (a frozen network: no error,
// no disconnect) while its leases, renewed over another connection, stay
// live reads nothing more: its pull requests are lost. With jobs waiting,
// the partition must show as stalled, whether FetchWait is long enough for
// idle heartbeats or not: a request that ended with no word from the
// server says nothing about the partition being caught up, and must not
// hide the stall again.
func TestLostPullRequestsShowAsAStall(t *testing.T) {
	t.Parallel()
	for _, wait := range []time.Duration{200 * time.Millisecond, time.Second} {
		t.Run(wait.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1, natstest.Listen())
			proxy := natstest.NewProxy(t, e.srv.URL())
			nc, err := nats.Connect(proxy.URL())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			var runs runLog
			rec := newRecorder()
			cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error { runs.add(j); return nil }))
			cfg.JetStream = js
			cfg.Observer = rec
			cfg.FetchWait = wait
			cfg.StallAfter = 2 * time.Second
			r := start(t, cfg)
			e.enqueue(t, 0, 1)
			rec.waitFor(t, 30*time.Second, "the first job to run", func() bool { return runs.n.Load() >= 1 })
			proxy.Freeze()
			e.enqueue(t, 1, 5)
			// Stalled for longer than a few lost requests: a stall that each
			// lost request hid again would never get there.
			rec.waitFor(t, 30*time.Second, "the partition to stay stalled", func() bool {
				st := r.w.Stalled()
				return len(st) > 0 && st[0].For >= 3*cfg.StallAfter
			})
			if runs.n.Load() != 1 {
				t.Fatalf("%d jobs ran through a frozen connection", runs.n.Load())
			}
			proxy.Thaw()
			rec.waitFor(t, time.Minute, "the jobs to run once the connection thaws", func() bool { return runs.n.Load() >= 6 })
		})
	}
}
