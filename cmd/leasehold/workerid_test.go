package main

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
)

// Two `leasehold worker` processes under one ID: the second exits with an
// error naming --worker-id while the first keeps its ID, instead of
// waiting for ever beside it. Its context outlasts nothing: the TTL is
// longer than the test gives it, so only the first's renewals can tell it.
func TestWorkerWithATakenIDExits(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, time.Minute, "--partitions", "2")
	worker := func(id string) []string {
		return []string{"worker", "--nats", s.URL(), "--worker-id", id, "--ttl", "6s", "--http", "", "--log-level", "error"}
	}
	_, firstDone := background(t, worker("twin")...)
	for {
		out, err := run(t, ctx, "status", "--nats", s.URL(), "--json")
		var st coordinator.Status
		if err == nil && json.Unmarshal([]byte(out), &st) == nil && slices.Contains(st.Members, "twin") {
			break
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			t.Fatalf("the first worker never registered: %v\n%s", err, out)
		}
	}
	sctx, stop := context.WithTimeout(ctx, 30*time.Second)
	defer stop()
	_, err := run(t, sctx, worker("twin")...)
	if err == nil || sctx.Err() != nil || !strings.Contains(err.Error(), "--worker-id") || !strings.Contains(err.Error(), `"twin" is taken`) {
		t.Fatalf("the second worker under the ID: %v; want it to exit at once with an error naming --worker-id", err)
	}
	select {
	case err := <-firstDone:
		t.Fatalf("the first worker stopped: %v", err)
	default:
	}
}

// The default ID is the host name and a suffix of its own for each
// process: two workers on one host, or a restarted container, never share
// one.
func TestDefaultWorkerIDIsPerProcess(t *testing.T) {
	t.Parallel()
	host, _ := os.Hostname()
	a, b := defaultWorkerID(), defaultWorkerID()
	if a == b || !strings.HasPrefix(a, sanitize(host)+"-") || len(a) != len(sanitize(host))+7 {
		t.Errorf("default IDs %q and %q: want the host name %q and six hex digits, each its own", a, b, host)
	}
}
