package main

import (
	"bytes"
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The example against an embedded NATS server: what it prints, and what
// reached the downstream handler.
func TestExample(t *testing.T) {
	srv := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	got, err := play(ctx, &out, config{NATS: srv.URL(), Partitions: 2, Jobs: 8})
	if err != nil {
		t.Fatalf("run: %v\noutput:\n%s", err, out.String())
	}
	text := out.String()
	t.Log("\n" + text)

	// Orders go to partition (N-1) mod 2: partition 0 has o-1, o-3, o-5,
	// o-7, and worker-a's message for the middle one, o-5, hangs.
	m := regexp.MustCompile(`The message is stamped \(partition 0, epoch (\d+), key (\S+)\)`).FindStringSubmatch(text)
	if m == nil {
		t.Fatal("the output does not show the stuck message's stamp")
	}
	e1, err := leasehold.ParseEpoch(m[1])
	if err != nil {
		t.Fatal(err)
	}
	zombieKey := m[2]
	m = regexp.MustCompile(`worker-b holds partition 0 at epoch (\d+) > worker-a's`).FindStringSubmatch(text)
	if m == nil {
		t.Fatal("the output does not show worker-b's epoch")
	}
	e2, err := leasehold.ParseEpoch(m[1])
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"worker-a ships 6 orders; its message for o-5 hangs in the network",
		"The middleware's maximum for partition 0 is now " + e2.String(),
		"leasehold: scope shipping partition 0: epoch " + e1.String() + " is below the recorded " + e2.String() + ": worker worker-a lost its lease",
		"worker-a's Publish returned nil",
		"errors.Is(err, leasehold.ErrLeaseLost) = true",
		"worker-b shipped o-5, o-7,",
		"8 orders shipped, each once",
		"from worker-a: o-1, o-2, o-3, o-4, o-6, o-8",
		"from worker-b: o-5, o-7",
		"o-5: shipped from worker-b under epoch " + e2.String(),
		"stale messages dropped by the middleware: 1 (partition 0)",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the output lacks %q", want)
		}
	}

	// The downstream handler ran for every order, never for the stale
	// message; after the take-over, partition 0's messages all came from
	// worker-b.
	shipped := map[string]int{}
	for _, s := range got.shipments {
		if !s.Repeat {
			shipped[s.Order]++
		}
		if s.Stamp.Key == zombieKey && s.Stamp.Epoch == e1 {
			t.Errorf("the handler ran for worker-a's stale message %+v", s)
		}
		switch s.Order {
		case "o-5", "o-7":
			if s.Stamp.Worker != "worker-b" || s.Stamp.Epoch != e2 {
				t.Errorf("order %s shipped from %s under %d, want worker-b under %d", s.Order, s.Stamp.Worker, s.Stamp.Epoch, e2)
			}
		}
		if s.Stamp.Partition == 0 && s.Stamp.Worker == "worker-a" && s.Stamp.Epoch != e1 {
			t.Errorf("a message of partition 0 from worker-a under epoch %d, not %d", s.Stamp.Epoch, e1)
		}
	}
	if len(shipped) != 8 {
		t.Errorf("%d orders shipped, want 8: %v", len(shipped), shipped)
	}
	if len(got.dropped) != 1 {
		t.Fatalf("%d messages dropped, want 1: %+v", len(got.dropped), got.dropped)
	}
	d := got.dropped[0]
	var stale *leasehold.StaleEpochError
	if d.Outcome != sink.Stale || !errors.As(d.Err, &stale) || d.Stamp.Key != zombieKey || stale.Epoch != e1 || stale.Max != e2 {
		t.Errorf("drop %+v (%v): want worker-a's message %s refused at epoch %d under %d", d, d.Err, zombieKey, e1, e2)
	}

	// A second run on the same server starts over with the old jobs
	// purged.
	out.Reset()
	if err := run(ctx, &out, config{NATS: srv.URL(), Partitions: 2, Jobs: 8}); err != nil {
		t.Fatalf("second run: %v\noutput:\n%s", err, out.String())
	}
	for _, want := range []string{"(purged the 8 jobs of an earlier run from the job stream)", "8 orders shipped, each once"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("second run: the output lacks %q", want)
		}
	}
}

// With no URL the program starts a server of its own.
func TestExampleEmbedded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, config{Partitions: 1, Jobs: 3}); err != nil {
		t.Fatalf("run: %v\noutput:\n%s", err, out.String())
	}
	for _, want := range []string{"an embedded server", "is below the recorded", "3 orders shipped, each once"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output lacks %q", want)
		}
	}
}

func TestBadConfig(t *testing.T) {
	err := run(context.Background(), &bytes.Buffer{}, config{Partitions: 1000, Jobs: -1, Prefix: "a b"})
	if err == nil {
		t.Fatal("want an error")
	}
	for _, want := range []string{"-partitions 1000", "-jobs -1", `-prefix "a b"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	err = run(context.Background(), &bytes.Buffer{}, config{NATS: "nats://127.0.0.1:1"})
	if err == nil || !strings.Contains(err.Error(), "is the server up") {
		t.Errorf("unreachable server: %v, want an error that says what to check", err)
	}
}
