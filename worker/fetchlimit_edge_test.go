package worker_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/leasehold/leasehold/testing/natstest"
)

// A server whose JetStream limits cap a pull request's batch
// (max_request_batch) gives every consumer that cap, and answers a request
// for more with 409 Exceeded MaxRequestBatch. The worker asks for no more
// than its consumer allows, so that jobs flow with the default FetchBatch.
func TestFetchBatchAboveTheServersRequestLimit(t *testing.T) {
	e := newEnv(t, 1, natstest.Tweak(func(o *server.Options) { o.JetStreamLimits.MaxRequestBatch = 10 }))
	const total = 50
	e.enqueue(t, 0, total)
	runs, rec := e.startRecorded(t)
	rec.waitFor(t, 30*time.Second, "every job to run", func() bool { return runs.n.Load() >= total })
}
