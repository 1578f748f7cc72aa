package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// The worker's concurrency flags are read strictly, before it connects.
func TestWorkerConcurrencyFlags(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--order", "stream"}, "--order"},
		{[]string{"--partition-concurrency", "0"}, "--partition-concurrency 0"},
		{[]string{"--partition-concurrency", "257"}, "--partition-concurrency 257"},
		{[]string{"--concurrency", "-1"}, "--concurrency -1"},
	} {
		args := append([]string{"worker", "--nats", "nats://127.0.0.1:1", "--http", ""}, c.args...)
		if _, err := run(t, ctx, args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %s", c.args, err, c.want)
		}
	}
	for _, o := range []string{"key", "partition", "none"} {
		if _, err := worker.ParseOrder(o); err != nil {
			t.Errorf("--order %s: %v", o, err)
		}
	}
}
