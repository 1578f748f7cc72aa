package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// The walk-through runs to the end, and the server, read without the
// program's help, holds host-b's report, stamped in the lock's scope at an
// epoch above the one host-a was refused at.
func TestLateReportIsRefused(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, srv.URL()); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Log("\n" + out.String())
	for _, want := range []string{`lock "nightly-report"`, "is below the recorded", "lease lost",
		report + ` = "orders=42, computed by host-b", written by host-b`} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output lacks %q", want)
		}
	}
	js := srv.JetStream(t)
	stream, err := js.Stream(ctx, "KV_reports")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := stream.GetLastMsgForSubject(ctx, "$KV.reports."+report)
	if err != nil {
		t.Fatal(err)
	}
	st, err := leasehold.StampFromHeader(raw.Header)
	if err != nil {
		t.Fatal(err)
	}
	if string(raw.Data) != "orders=42, computed by host-b" || st.Worker != "host-b" {
		t.Errorf("%s = %q stamped by %s, want host-b's report", report, raw.Data, st.Worker)
	}
	if want := leasehold.LockScope("reports", lock); st.Scope != want || st.Partition != 0 {
		t.Errorf("the report is stamped in scope %q, partition %d; want %q, 0", st.Scope, st.Partition, want)
	}
	// host-b's epoch is above host-a's, and the sink's fence for the lock
	// stands at it.
	var e1, e2 uint64
	for _, f := range []struct {
		re string
		to *uint64
	}{{`epoch e1 = (\d+)`, &e1}, {`epoch e2 = (\d+)`, &e2}} {
		m := regexp.MustCompile(f.re).FindStringSubmatch(out.String())
		if m == nil {
			t.Fatalf("the output lacks %s", f.re)
		}
		*f.to, _ = strconv.ParseUint(m[1], 10, 64)
	}
	if uint64(st.Epoch) != e2 || e2 <= e1 {
		t.Errorf("the report is stamped with epoch %d; host-a held e1 = %d, host-b e2 = %d", st.Epoch, e1, e2)
	}
	reports, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "reports"})
	if err != nil {
		t.Fatal(err)
	}
	fence, err := reports.Fence(ctx, leasehold.FenceID{Scope: st.Scope, Partition: 0})
	if err != nil || uint64(fence.Epoch) != e2 || fence.Holder != "host-b" {
		t.Errorf("the sink's fence for the lock: %+v, %v; want host-b at %d", fence, err, e2)
	}
}

// The guide shows this program's code: every Go block of docs/locks.md is
// a run of main.go's lines (indentation aside), so the guide cannot drift
// from the code its test runs.
func TestGuideShowsThisProgram(t *testing.T) {
	t.Parallel()
	guide, err := os.ReadFile("../../docs/locks.md")
	if err != nil {
		t.Fatal(err)
	}
	program, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	unindent := func(s string) string {
		lines := strings.Split(strings.TrimSpace(s), "\n")
		for i, l := range lines {
			lines[i] = strings.TrimLeft(l, "\t")
		}
		return strings.Join(lines, "\n")
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```\n").FindAllStringSubmatch(string(guide), -1)
	if len(blocks) < 3 {
		t.Fatalf("docs/locks.md shows %d Go blocks, want the recipe's", len(blocks))
	}
	code := unindent(string(program))
	for _, b := range blocks {
		if !strings.Contains(code, unindent(b[1])) {
			t.Errorf("docs/locks.md shows code that examples/singleton/main.go does not hold:\n%s", b[1])
		}
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
