package main

import (
	"strings"
	"testing"
	"time"
)

// --rate is a float from the command line: a rate above a job a
// nanosecond made a zero ticker interval, and time.NewTicker panics on
// one. Any positive rate enqueues, as fast as the server takes them at
// most.
func TestEnqueueHugeRate(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, 60*time.Second, "--partitions", "2")
	for _, rate := range []string{"5e9", "+Inf"} {
		out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "-n", "3", "--rate", rate)
		if err != nil || !strings.Contains(out, "enqueued 3 jobs") {
			t.Errorf("enqueue --rate %s: %v\n%s", rate, err, out)
		}
	}
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "-n", "3", "--rate", "NaN"); err == nil {
		t.Errorf("enqueue --rate NaN: no error\n%s", out)
	}
}
