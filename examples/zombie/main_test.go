package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestWalkthrough(t *testing.T) {
	srv := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, config{NATS: srv.URL(), TTL: time.Second}); err != nil {
		t.Fatalf("run: %v\noutput:\n%s", err, out.String())
	}
	text := out.String()
	t.Log("\n" + text)

	e1 := epochIn(t, text, `worker-a holds partition 0 at epoch e1 = (\d+)\.`)
	e2 := epochIn(t, text, `worker-b holds partition 0 at epoch e2 = (\d+) > e1`)
	if e2 <= e1 {
		t.Fatalf("e2 = %d is not above e1 = %d", e2, e1)
	}
	for _, want := range []string{
		"worker-b: Acquire -> coordinator: partition 0 is held by worker-a at epoch " + e1.String(),
		"-> refused: leasehold: scope zombie-walkthrough partition 0: epoch " + e1.String() + " is below the recorded " + e2.String() +
			": worker worker-a lost its lease and the write was not applied (the partition is held by worker-b)",
		"errors.Is(err, leasehold.ErrStaleEpoch) = true",
		"worker-a: Commit(2) -> refused: leasehold: lease lost: partition 0 epoch " + e1.String() +
			" held by worker-a: the server refused the write because another worker took the partition (now held by worker-b)",
		"errors.Is(err, leasehold.ErrLeaseLost) = true",
		"accounts.alice = 120   (written by worker-b under epoch " + e2.String(),
		"stale writes refused = 1",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the output lacks %q", want)
		}
	}
	if n := strings.Count(text, "-> accepted"); n != 3 {
		t.Errorf("%d writes accepted, want 3 (worker-a's job 1, worker-b's jobs 2 and 3)", n)
	}

	// What the server holds, read without the program's help.
	js := srv.JetStream(t)
	kv, err := js.KeyValue(ctx, defaultName+"-effects")
	if err != nil {
		t.Fatal(err)
	}
	entry, err := kv.Get(ctx, "accounts.alice")
	if err != nil {
		t.Fatal(err)
	}
	if string(entry.Value()) != "120" {
		t.Errorf("accounts.alice = %q, want 120", entry.Value())
	}
	msg, err := js.Stream(ctx, "KV_"+defaultName+"-effects")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := msg.GetLastMsgForSubject(ctx, "$KV."+defaultName+"-effects.accounts.alice")
	if err != nil {
		t.Fatal(err)
	}
	st, err := leasehold.StampFromHeader(raw.Header)
	if err != nil {
		t.Fatal(err)
	}
	if st.Epoch != e2 || st.Worker != "worker-b" || st.Key != "zombie-walkthrough.0.3.0" {
		t.Errorf("accounts.alice is stamped %+v, want worker-b's job 3 under epoch %d", st, e2)
	}
	bucket, err := coordinator.OpenBucket(ctx, js, defaultName+"-leases")
	if err != nil {
		t.Fatal(err)
	}
	status, err := bucket.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range status.Partitions {
		if p.Partition == 0 && (p.FencedEpoch != e2 || p.Progress != 3) {
			t.Errorf("partition 0: fenced at %d with progress %d, want epoch %d and progress 3", p.FencedEpoch, p.Progress, e2)
		}
	}

	// A second run on the same server starts clean, with higher epochs.
	out.Reset()
	if err := run(ctx, &out, config{NATS: srv.URL(), TTL: time.Second}); err != nil {
		t.Fatalf("second run: %v\noutput:\n%s", err, out.String())
	}
	if again := epochIn(t, out.String(), `worker-a holds partition 0 at epoch e1 = (\d+)\.`); again <= e2 {
		t.Errorf("the second run started at epoch %d, not above the first run's %d", again, e2)
	}
}

// With no URL the program starts a server of its own.
func TestWalkthroughEmbedded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, config{TTL: time.Second}); err != nil {
		t.Fatalf("run: %v\noutput:\n%s", err, out.String())
	}
	for _, want := range []string{"NATS:          an embedded server", "is below the recorded", "accounts.alice = 120"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output lacks %q", want)
		}
	}
}

func TestBadConfig(t *testing.T) {
	err := run(context.Background(), &bytes.Buffer{}, config{Name: "a.b", TTL: 1500 * time.Millisecond})
	if err == nil {
		t.Fatal("want an error")
	}
	for _, want := range []string{`-name "a.b": use letters, digits`, "-ttl 1.5s: JetStream expires keys in whole seconds"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	err = run(context.Background(), &bytes.Buffer{}, config{NATS: "nats://127.0.0.1:1"})
	if err == nil || !strings.Contains(err.Error(), "is the server up?") {
		t.Errorf("unreachable server: %v, want an error that says what to check", err)
	}
}

func epochIn(t *testing.T, text, pattern string) leasehold.Epoch {
	t.Helper()
	m := regexp.MustCompile(pattern).FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("the output has no line matching %q", pattern)
	}
	e, err := leasehold.ParseEpoch(m[1])
	if err != nil {
		t.Fatal(err)
	}
	return e
}
