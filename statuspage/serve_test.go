package statuspage

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// One call gives a program of its own what the command has: a write its
// sink refused reaches the page through the observer Serve hands out;
// /metrics serves the metrics recorded through Serve's telemetry (the
// page's own drop counter among them), /livez answers, /readyz runs the
// checks added once the program's parts exist; and Close stops it all.
func TestServeGivesAProgramThePage(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := s.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := ProvisionEvents(ctx, js, "shop", 1); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "shop-leases", Scope: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	p, err := Serve(ctx, ServeConfig{JetStream: js, Bucket: b, Prefix: "shop", Name: "shop-1", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if !strings.HasPrefix(p.URL(), "http://127.0.0.1:") {
		t.Fatalf("URL %q", p.URL())
	}

	// A zombie's write, refused by a sink built with the page's observer.
	mem := sink.NewMemory(sink.MemoryConfig{Observer: p.SinkObserver(), Telemetry: p.Telemetry()})
	refuseAZombie(t, ctx, mem, "shop", 2)
	st := waitState(t, ctx, p.URL(), "the refusal", func(st State) bool {
		return len(st.Refusals) == 1 && st.Refusals[0].Worker == "zombie" && st.Refusals[0].Source == "shop-1" && st.Refusals[0].Max == 20
	})
	if st.ServedBy != "shop-1" || len(st.Errors) != 0 {
		t.Errorf("served by %q, errors %q", st.ServedBy, st.Errors)
	}

	if code, body := get(t, p.URL()+"metrics"); code != 200 || !strings.Contains(body, "leasehold_sink_effects_total") {
		t.Errorf("/metrics: %d, without the sink's decisions:\n%.500s", code, body)
	}
	if code, _ := get(t, p.URL()+"livez"); code != 200 {
		t.Errorf("/livez: %d", code)
	}
	if code, body := get(t, p.URL()+"readyz"); code != 200 {
		t.Errorf("/readyz before any check was added: %d %s", code, body)
	}
	p.Ready(func(context.Context) error { return errors.New("the worker is stalled") })
	if code, body := get(t, p.URL()+"readyz"); code != 503 || !strings.Contains(body, "the worker is stalled") {
		t.Errorf("/readyz with a failing check: %d %s", code, body)
	}
	// The page itself carries the state it starts with.
	if _, body := get(t, p.URL()); !strings.Contains(body, `"served_by":"shop-1"`) || strings.Contains(body, statePlaceholder) {
		t.Errorf("the page does not carry its first state:\n%.400s", body)
	}

	// A taken address fails Serve at once, naming it.
	if _, err := Serve(ctx, ServeConfig{JetStream: js, Prefix: "shop", Addr: p.Addr()}); err == nil || !strings.Contains(err.Error(), p.Addr()) {
		t.Errorf("Serve on a taken address: %v", err)
	}
	addr := p.Addr()
	p.Close()
	p.Close()
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Error("still listening after Close")
	}
}

// The status table's renewal of a partition held by a session is the
// session's, and says so; one whose session ended says that instead.
func TestRowsShowSessionRenewals(t *testing.T) {
	t.Parallel()
	now := time.Now()
	st := coordinator.Status{Partitions: []coordinator.PartitionStatus{
		{Partition: 0, Holder: "a", Epoch: 1796529141447291, Acquired: now.Add(-7 * time.Minute), Renewed: now.Add(-1200 * time.Millisecond), Session: 99, FencedEpoch: 1796529141447291},
		{Partition: 1, Holder: "b", Epoch: 1796529141447292, Acquired: now.Add(-7 * time.Minute), Renewed: now.Add(-7 * time.Minute), Session: 98, SessionEnded: true},
		{Partition: 2, Holder: "c", Epoch: 12, Acquired: now.Add(-time.Minute), Renewed: now.Add(-2 * time.Second)},
		{Partition: 3},
	}}
	rows, _ := Rows(st, now)
	for i, want := range []string{"1.2s ago (session)", "session ended", "2s ago", "-"} {
		if rows[i].Renewed != want {
			t.Errorf("partition %d renewed %q, want %q", i, rows[i].Renewed, want)
		}
	}
	if rows[0].Epoch != "1796529141447291" {
		t.Errorf("a row's epoch is %q: rows carry it whole", rows[0].Epoch)
	}
}

func TestShortEpoch(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"1796529141447291": "…447291",
		"1234567":          "1234567",
		"12":               "12",
		"-":                "-",
		"12345678x":        "12345678x",
	} {
		if got := ShortEpoch(in); got != want {
			t.Errorf("ShortEpoch(%q) = %q, want %q", in, got, want)
		}
	}
}

// A lost lease's reason on the page is one line: what happened, and who
// holds the partition now; not the error with every cause it wraps.
func TestLossReasonIsOneLine(t *testing.T) {
	t.Parallel()
	lease := leasehold.Lease{Scope: "shop", Partition: 3, Epoch: 1796529141447291, Holder: "a"}
	member := &coordinator.LostError{Lease: lease, Member: true, Reason: coordinator.LostDeadline, Err: errors.New("nats: timeout")}
	for _, c := range []struct {
		err  error
		want string
	}{
		{&coordinator.LostError{Lease: lease, Reason: coordinator.LostRefused, Holder: "b", Err: errors.New("commit progress 1: partition.3 fenced at epoch 1796529141447300")},
			"refused: another write replaced the lease (a take-over, or `leasehold fence`); now held by b"},
		{&coordinator.LostError{Lease: lease, Reason: coordinator.LostSession, Err: member}, "session: the worker's member registration ended (no renewal in time)"},
		{fmt.Errorf("worker: %w", &coordinator.LostError{Lease: lease, Reason: coordinator.LostDeadline}), "deadline: no renewal succeeded before the lease's local deadline"},
		{errors.New("first line\nsecond line"), "first line"},
		{nil, ""},
	} {
		if got := LossReason("", "", c.err); got != c.want {
			t.Errorf("LossReason(%v) = %q, want %q", c.err, got, c.want)
		}
	}
	if got := LossReason(coordinator.LostRefused, "b", errors.New("x: y: z")); !strings.HasPrefix(got, "refused: ") || strings.Contains(got, "x: y") {
		t.Errorf("a lock's loss: %q", got)
	}
}

// A program that provisions its job streams with worker.ProvisionJobs, as
// the quickstart does, and serves the page has the events stream too: a
// write its sink refuses reaches the page, which does not say the stream
// is missing.
func TestProvisionJobsCreatesTheEventsStream(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "mine", Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	p, err := Serve(ctx, ServeConfig{JetStream: js, Prefix: "mine", Name: "mine-1", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	mem := sink.NewMemory(sink.MemoryConfig{Observer: p.SinkObserver()})
	refuseAZombie(t, ctx, mem, "mine", 1)
	st := waitState(t, ctx, p.URL(), "the refusal", func(st State) bool {
		return len(st.Refusals) == 1 && st.Refusals[0].Worker == "zombie"
	})
	if len(st.Errors) != 0 {
		t.Errorf("the page says: %q", st.Errors)
	}
}
