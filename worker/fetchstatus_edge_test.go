package worker_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold/worker"
)

// A job with an empty body and a header named Status looks, by its
// headers alone, like one of the statuses the server ends or keeps a pull
// request alive with. It is a job all the same (it came with the reply
// subject a stored message is delivered with) and must reach the handler,
// in order, like any other.
func TestJobWithAStatusHeaderIsAJob(t *testing.T) {
	e := newEnv(t, 1)
	ctx := ctxFor(t, time.Minute)
	p := e.producer(t)
	for _, status := range []string{"100", "408", "409"} {
		if _, err := p.EnqueueTo(ctx, 0, nil, worker.WithHeader(nats.Header{"Status": []string{status}})); err != nil {
			t.Fatal(err)
		}
		if _, err := p.EnqueueTo(ctx, 0, []byte("after "+status)); err != nil {
			t.Fatal(err)
		}
	}
	runs, rec := e.startRecorded(t)
	rec.waitFor(t, 30*time.Second, "all six jobs to run", func() bool { return runs.n.Load() >= 6 })
	for i, r := range runs.all() {
		if r.Seq != uint64(i+1) {
			t.Errorf("run %d was job %d, want job %d", i, r.Seq, i+1)
		}
	}
}
