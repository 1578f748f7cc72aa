package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

// --partitions is read from the job stream by every command; given and
// different, it is an error that names both counts, whether it came from
// the flag or from the environment.
func TestPartitionsFromTheJobStream(t *testing.T) {
	s, ctx := listening(t, 60*time.Second)
	// No job stream yet: commands that need its count say so.
	if _, err := run(t, ctx, "enqueue", "--nats", s.URL()); err == nil || !strings.Contains(err.Error(), "no job stream leasehold-jobs") {
		t.Fatalf("enqueue before init: %v", err)
	}
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", "3")
	// init again without --partitions keeps the stream's count.
	if out, err := run(t, ctx, "init", "--nats", s.URL()); err != nil || !strings.Contains(out, "(3 partitions") {
		t.Fatalf("init without --partitions on a 3-partition stream: %v\n%s", err, out)
	}
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "-n", "6"); err != nil || !strings.Contains(out, "enqueued 6 jobs") {
		t.Fatalf("enqueue without --partitions: %v\n%s", err, out)
	}
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "--partitions", "3"); err != nil {
		t.Fatalf("enqueue with the stream's count: %v\n%s", err, out)
	}
	for _, args := range [][]string{
		{"enqueue", "--partitions", "5"},
		{"worker", "--partitions", "5", "--http", ""},
		{"init", "--partitions", "5"},
	} {
		_, err := run(t, ctx, append(args, "--nats", s.URL())...)
		if err == nil || !strings.Contains(err.Error(), "--partitions 5") || !strings.Contains(err.Error(), "has 3 partitions") {
			t.Errorf("%v on a 3-partition stream: %v", args, err)
		}
	}
	t.Setenv("LEASEHOLD_PARTITIONS", "4")
	if _, err := run(t, ctx, "enqueue", "--nats", s.URL()); err == nil || !strings.Contains(err.Error(), "--partitions 4") || !strings.Contains(err.Error(), "has 3 partitions") {
		t.Errorf("LEASEHOLD_PARTITIONS=4 on a 3-partition stream: %v", err)
	}
}

// A prefix with no job stream is an error naming the prefixes there are,
// and a lease bucket of another prefix is refused rather than shown.
func TestStatusRefusesAnUnknownPrefix(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	startFleet(t, s, 1, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := run(t, ctx, "status", "--nats", s.URL(), "--prefix", "nope")
	if err == nil || !strings.Contains(err.Error(), "--prefix nope") || !strings.Contains(err.Error(), "job streams of prefix leasehold") {
		t.Fatalf("status --prefix nope: %v", err)
	}
	_, err = run(t, ctx, "status", "--nats", s.URL(), "--prefix", "nope", "--bucket", "leasehold-leases")
	if err == nil || !strings.Contains(err.Error(), `serves the job stream of prefix "leasehold"`) {
		t.Fatalf("status --prefix nope --bucket leasehold-leases: %v", err)
	}
	if _, err := run(t, ctx, "fence", "1", "--nats", s.URL(), "--prefix", "nope"); err == nil || !strings.Contains(err.Error(), "--prefix nope") {
		t.Fatalf("fence --prefix nope: %v", err)
	}
	waitStatus(t, ctx, "the 4 partitions", func(st coordinator.Status) bool {
		return len(st.Partitions) == 4
	}, "--nats", s.URL(), "--prefix", "leasehold")
}
