package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/internal/testskip"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

func TestMain(m *testing.M) {
	if fleet.IsChild() {
		// Started by the demo, the chaos harness or a benchmark as the
		// leasehold command: be it.
		main()
		os.Exit(0)
	}
	testpar.Raise(4)
	goleak.VerifyTestMain(testskip.Summarize(m))
}

// run executes the command line args and returns what it printed.
func run(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	root := newRoot()
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}

// startFleet runs n coordinators over partitions on s until the test ends.
func startFleet(t *testing.T, s *natstest.Server, n, partitions int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if err := worker.ProvisionJobs(ctx, s.JetStream(t), worker.JobsConfig{Prefix: "leasehold", Partitions: partitions}); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, s.JetStream(t), coordinator.BucketConfig{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{}, n)
	for i := range n {
		c, err := coordinator.New(b, coordinator.Config{Worker: "w" + string(rune('a'+i)), Partitions: partitions, TTL: 2 * time.Second,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		go func() { c.Run(ctx); done <- struct{}{} }()
	}
	t.Cleanup(func() {
		cancel()
		for range n {
			<-done
		}
	})
}

// fleets lets one test at a time run a fleet of processes of this (race-
// detecting) binary: a chaos run, the demo, a status page over frozen
// workers. Each fleet keeps both cores of a small machine busy, and its
// failovers are judged against lease TTLs; the tests that only call the
// command in this process run beside it.
var fleets = make(chan struct{}, 1)

// oneFleet waits for the fleet slot and returns the function that gives
// it back: call it as `defer oneFleet(t)()`, after t.Parallel.
func oneFleet(t *testing.T) func() {
	t.Helper()
	fleets <- struct{}{}
	return func() { <-fleets }
}

// listening starts a server the command reaches over loopback TCP, as it
// would a real one, and a context that ends after d or with the test.
func listening(t *testing.T, d time.Duration) (*natstest.Server, context.Context) {
	t.Helper()
	s := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return s, ctx
}
