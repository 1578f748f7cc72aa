package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// The walk-through runs to the end, and the server, read without the
// program's help, holds worker-b's balance, not the zombie's.
func TestZombieIsRefused(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, srv.URL()); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Log("\n" + out.String())
	for _, want := range []string{"is below the recorded", "lease lost", "accounts.alice = 120, written by worker-b"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output lacks %q", want)
		}
	}
	js := srv.JetStream(t)
	stream, err := js.Stream(ctx, "KV_zombie-effects")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := stream.GetLastMsgForSubject(ctx, "$KV.zombie-effects."+account)
	if err != nil {
		t.Fatal(err)
	}
	st, err := leasehold.StampFromHeader(raw.Header)
	if err != nil {
		t.Fatal(err)
	}
	if string(raw.Data) != "120" || st.Worker != "worker-b" {
		t.Errorf("%s = %q stamped by %s, want 120 by worker-b", account, raw.Data, st.Worker)
	}
}

// With no URL the program starts a server of its own.
func TestEmbedded(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, ""); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "refused: ") {
		t.Errorf("no refusal in\n%s", out.String())
	}
}
