package worker_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A server whose JetStream limits cap a pull request's batch
// (max_request_batch) gives every consumer that cap, and answers a request
// for more with 409 Exceeded MaxRequestBatch. The worker asks for no more
// than its consumer allows, so that jobs flow with the default FetchBatch.
func TestFetchBatchAboveTheServersRequestLimit(t *testing.T) {
	e := newEnv(t, 1, natstest.Tweak(func(o *server.Options) { o.JetStreamLimits.MaxRequestBatch = 10 }))
	const total = 50
	e.enqueue(t, 0, total)
	var runs runLog
	rec := newRecorder()
	cfg := e.config("w", worker.HandlerFunc(func(_ context.Context, j *worker.Job) error {
		runs.add(j)
		return nil
	}))
	cfg.Observer = rec
	start(t, cfg)
	rec.waitFor(t, 30*time.Second, "every job to run", func() bool { return runs.n.Load() >= total })
}
