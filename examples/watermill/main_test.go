package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The example runs to the end on a given server, twice, then on its own
// embedded one; each time the middleware dropped worker-a's message as
// stale and the handler shipped each order once, o-2 from worker-b.
func TestStaleMessageDropped(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	for _, url := range []string{srv.URL(), srv.URL(), ""} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var out bytes.Buffer
		drop, err := run(ctx, &out, url)
		if err != nil {
			t.Fatalf("run: %v\n%s", err, out.String())
		}
		t.Log("\n" + out.String())
		var stale *leasehold.StaleEpochError
		if drop.Outcome != sink.Stale || !errors.As(drop.Err, &stale) || drop.Stamp.Worker != "worker-a" || stale.Max <= stale.Epoch {
			t.Errorf("drop %+v (%v): want worker-a's message refused below a higher epoch", drop.Stamp, drop.Err)
		}
		if n := strings.Count(out.String(), "downstream shipped"); n != 3 {
			t.Errorf("the handler ran %d times, want 3", n)
		}
		for _, want := range []string{"shipped o-1 from worker-a", "shipped o-2 from worker-b", "shipped o-3 from worker-b"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("the output lacks %q", want)
			}
		}
	}
}
