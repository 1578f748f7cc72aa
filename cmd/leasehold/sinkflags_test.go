package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// --atomic-jobs names what only a downstream stream does: with any other
// kind it is refused at once, saying so, before anything connects.
func TestSinkAtomicJobsIsForStreams(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := run(t, ctx, "sink", "--kind", "kv", "--atomic-jobs", "--nats", "nats://127.0.0.1:1", "--http", "")
	if err == nil || !strings.Contains(err.Error(), "--atomic-jobs is for --kind stream") {
		t.Errorf("sink --kind kv --atomic-jobs: %v, want it refused as for --kind stream", err)
	}
}
