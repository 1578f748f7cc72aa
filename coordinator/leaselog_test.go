package coordinator_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testbuf"
	"github.com/leasehold/leasehold/testing/natstest"
)

// logBuf is a log the test reads while coordinators write it.
type logBuf struct{ testbuf.Buffer }

func (b *logBuf) lines(msg string) []string {
	var out []string
	for _, l := range strings.Split(b.String(), "\n") {
		if strings.Contains(l, "msg="+msg+" ") || strings.Contains(l, `msg="`+msg+`"`) {
			out = append(out, l)
		}
	}
	return out
}

func loggedCoord(t *testing.T, b *coordinator.Bucket, worker string, ttl time.Duration, log *logBuf) *coordinator.Coordinator {
	t.Helper()
	c, err := coordinator.New(b, coordinator.Config{Worker: worker, TTL: ttl, Partitions: 4,
		Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// The worker that takes a partition over says so at INFO, naming the
// previous holder and both epochs; lease-lost lines carry only the fields
// that have a value; the membership registration is named as such, never
// as a partition.
func TestLeaseLogLines(t *testing.T) {
	t.Parallel()
	js, b := startBucket(t)
	ctx := ctxFor(t, 30*time.Second)
	var alog, blog logBuf
	a, bc := loggedCoord(t, b, "alice", time.Second, &alog), loggedCoord(t, b, "bob", time.Second, &blog)

	la, err := a.Acquire(ctx, 1, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	if got := alog.lines("acquired partition"); len(got) != 1 || !strings.Contains(got[0], "level=INFO") || !strings.Contains(got[0], "partition=1 ") {
		t.Fatalf("first acquisition's log: %q\n%s", got, alog.String())
	}
	// alice cannot renew, so her lease runs out at its local deadline:
	// a loss with no successor known and no refusal.
	<-la.Done()
	lost := alog.lines("lease lost")
	if len(lost) != 1 || !strings.Contains(lost[0], "partition=1 ") || !strings.Contains(lost[0], "reason=deadline") {
		t.Fatalf("lease lost lines: %q\n%s", lost, alog.String())
	}
	for _, noise := range []string{"holder=", "err=", "member"} {
		if strings.Contains(lost[0], noise) {
			t.Errorf("lease lost line has %q: %s", noise, lost[0])
		}
	}
	lb := acquireEventually(t, bc, 1, 20*time.Second)
	defer lb.Release(ctx)
	took := blog.lines("took over partition")
	want := fmt.Sprintf("partition=1 epoch=%d worker=bob from=alice previous_epoch=%d", lb.Epoch(), la.Epoch())
	if len(took) != 1 || !strings.Contains(took[0], "level=INFO") || !strings.Contains(took[0], want) {
		t.Fatalf("take-over lines %q, want one at INFO with %q\n%s", took, want, blog.String())
	}

	// The membership registration: purged under a running group, its
	// renewal is refused and the loss is logged as the registration's.
	var clog logBuf
	c := loggedCoord(t, b, "carol", 2*time.Second, &clog)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() { stop(); <-done }()
	kv, err := js.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := kv.Get(ctx, "member.carol"); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("carol never registered:\n%s", clog.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := kv.Purge(ctx, "member.carol"); err != nil {
		t.Fatal(err)
	}
	for len(clog.lines("membership registration lost")) == 0 {
		if ctx.Err() != nil {
			t.Fatalf("carol's registration loss never logged:\n%s", clog.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, l := range strings.Split(clog.String(), "\n") {
		if strings.Contains(l, "member=true") || (strings.Contains(l, "lease lost") && !strings.Contains(l, "partition=")) {
			t.Errorf("membership logged as a partition lease: %s", l)
		}
	}
}

// The words of the log are the status page's: the worker that gets a
// partition its holder released says it was handed off; the one that
// gets a partition whose holder's session ended without a release says
// it took it over.
func TestHandOffAndTakeOverLogLines(t *testing.T) {
	t.Parallel()
	ctx := ctxFor(t, 60*time.Second)
	// Markers that outlast the hand-off, as the default minute does: bob
	// reads how alice let each partition go from its marker, and on a
	// loaded machine he may come to partition 1 more than a second after
	// her release.
	b, err := coordinator.Provision(ctx, natstest.Start(t).JetStream(t), coordinator.BucketConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var alog, blog logBuf
	alice := loggedCoord(t, b, "alice", 3*time.Second, &alog)
	// alice's session is never renewed: it ends at its TTL, as a crashed
	// worker's does, and her partition records stay behind it.
	sess, err := alice.RegisterSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := alice.AcquireInSession(ctx, 0, sess); err != nil {
		t.Fatal(err)
	}
	l1, err := alice.AcquireInSession(ctx, 1, sess)
	if err != nil {
		t.Fatal(err)
	}
	startMemberWith(t, b, "bob", 2, 3*time.Second, func(c *coordinator.Config) {
		c.Logger = slog.New(slog.NewTextHandler(&blog, nil))
	})
	if err := l1.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for len(blog.lines("partition handed off")) == 0 || len(blog.lines("took over partition")) == 0 {
		if ctx.Err() != nil {
			t.Fatalf("bob never got both partitions:\n%s", blog.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	off, took := blog.lines("partition handed off"), blog.lines("took over partition")
	if len(off) != 1 || !strings.Contains(off[0], "level=INFO") || !strings.Contains(off[0], "partition=1 ") || !strings.Contains(off[0], "from=alice") {
		t.Errorf("hand-off lines %q, want one for partition 1 from alice", off)
	}
	if len(took) != 1 || !strings.Contains(took[0], "partition=0 ") || !strings.Contains(took[0], "from=alice") {
		t.Errorf("take-over lines %q, want one for partition 0 from alice", took)
	}
}
