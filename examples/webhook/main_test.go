package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// The example runs to the end on a given NATS server, then on its own;
// each time relay-a's late request was refused by the verifier with 409,
// on the relay fence, naming relay-b's higher epoch, and the receiver
// charged the order once.
func TestZombieRelayRefused(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	for _, url := range []string{srv.URL(), ""} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var out bytes.Buffer
		ref, charges, err := run(ctx, &out, url)
		if err != nil {
			t.Fatalf("run: %v\n%s", err, out.String())
		}
		t.Log("\n" + out.String())
		if ref.Error != httpsink.CodeStaleEpoch || ref.Fence != httpsink.FenceRelay || ref.Holder != "relay-b" || ref.Max <= ref.Epoch {
			t.Errorf("relay-a's late request was answered %+v, want stale_epoch on the relay fence below relay-b's epoch", ref)
		}
		if !strings.Contains(out.String(), "late request gets 409") {
			t.Errorf("the output does not show the 409")
		}
		if charges["o-1"] != 1 {
			t.Errorf("o-1 was charged %d times, want once", charges["o-1"])
		}
	}
}
