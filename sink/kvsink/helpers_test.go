package kvsink_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Set-up the tests of this package share.

// Each test has a server (or a cluster) of its own: run more of them at
// once than the two a two-core machine gets by default.
func TestMain(m *testing.M) {
	testpar.Raise(4)
	testleak.VerifyTestMain(m)
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// onEachTopology runs f in a subtest on one server ("single") and, but in
// short mode, in one on a three-node cluster ("cluster"), with the
// replicas a bucket takes there.
func onEachTopology(t *testing.T, f func(t *testing.T, js jetstream.JetStream, replicas int)) {
	t.Helper()
	t.Run("single", func(t *testing.T) { f(t, natstest.Start(t).JetStream(t), 1) })
	t.Run("cluster", func(t *testing.T) {
		if testing.Short() {
			t.Skip("starts a three-node cluster")
		}
		f(t, natstest.StartCluster(t).JetStream(t), 3)
	})
}

type decisions struct {
	mu sync.Mutex
	ds []sink.Decision
}

func (d *decisions) Decided(_ context.Context, x sink.Decision) {
	d.mu.Lock()
	d.ds = append(d.ds, x)
	d.mu.Unlock()
}

func (d *decisions) of(o sink.Outcome) []sink.Decision {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []sink.Decision
	for _, x := range d.ds {
		if x.Outcome == o {
			out = append(out, x)
		}
	}
	return out
}
