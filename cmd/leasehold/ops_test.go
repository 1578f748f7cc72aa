package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/testskip"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

func TestMain(m *testing.M) {
	if fleet.IsChild() {
		// Started by the demo, the chaos harness or a benchmark as the
		// leasehold command: be it.
		main()
		os.Exit(0)
	}
	goleak.VerifyTestMain(testskip.Summarize(m))
}

// run executes the command line args and returns what it printed.
func run(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	root := newRoot()
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}

// startFleet runs n coordinators over partitions on s until the test ends.
func startFleet(t *testing.T, s *natstest.Server, n, partitions int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if err := worker.ProvisionJobs(ctx, s.JetStream(t), worker.JobsConfig{Prefix: "leasehold", Partitions: partitions}); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, s.JetStream(t), coordinator.BucketConfig{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{}, n)
	for i := range n {
		c, err := coordinator.New(b, coordinator.Config{Worker: "w" + string(rune('a'+i)), Partitions: partitions, TTL: 2 * time.Second,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		go func() { c.Run(ctx); done <- struct{}{} }()
	}
	t.Cleanup(func() {
		cancel()
		for range n {
			<-done
		}
	})
}

func TestStatusAndFence(t *testing.T) {
	s := natstest.Start(t, natstest.Listen())
	startFleet(t, s, 2, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var st coordinator.Status
	for {
		out, err := run(t, ctx, "status", "--nats", s.URL(), "--json")
		if err != nil {
			t.Fatalf("status: %v\n%s", err, out)
		}
		st = coordinator.Status{}
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("status --json: %v\n%s", err, out)
		}
		owned := 0
		for _, p := range st.Partitions {
			if p.Holder != "" {
				owned++
			}
		}
		if owned == 4 && len(st.Members) == 2 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("fleet never owned all partitions: %+v", st)
		}
		time.Sleep(50 * time.Millisecond)
	}
	before := st.Partitions[1]

	// A partition the job stream does not have is refused, and no record
	// appears for it.
	if out, err := run(t, ctx, "fence", "9", "--nats", s.URL()); err == nil || !strings.Contains(err.Error(), "PARTITION") {
		t.Fatalf("fence 9 on a 4-partition stream: %v\n%s", err, out)
	}
	// Read into a fresh value: an omitted field would keep the findings
	// of a read made while the fleet was starting.
	st = coordinator.Status{}
	if out, err := run(t, ctx, "status", "--nats", s.URL(), "--json"); err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	} else if after := (coordinator.Status{}); json.Unmarshal([]byte(out), &after) != nil || len(after.Partitions) != 4 || after.Partitions[3].Partition != 3 || slices.ContainsFunc(after.Findings, func(f coordinator.Finding) bool { return strings.HasSuffix(f.Key, ".9") }) {
		t.Fatalf("status after fence 9 shows a row or a finding for partition 9:\n%s", out)
	}

	out, err := run(t, ctx, "fence", "1", "--nats", s.URL())
	if err != nil {
		t.Fatalf("fence: %v\n%s", err, out)
	}
	if !strings.Contains(out, "removed the lease of "+before.Holder) {
		t.Fatalf("fence output: %s", out)
	}
	// The group takes the partition back with a higher epoch.
	for {
		out, err := run(t, ctx, "status", "--nats", s.URL(), "--json")
		if err != nil {
			t.Fatal(err)
		}
		var now coordinator.Status
		json.Unmarshal([]byte(out), &now)
		if p := now.Partitions[1]; p.Holder != "" && p.Epoch > before.Epoch && p.FencedEpoch > before.Epoch {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("partition 1 not re-acquired above epoch %d: %s", before.Epoch, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	out, err = run(t, ctx, "status", "--nats", s.URL())
	if err != nil || !strings.Contains(out, "PARTITION") || !strings.Contains(out, "2 live workers") {
		t.Fatalf("status table: %v\n%s", err, out)
	}
}

func TestSettingsPrecedence(t *testing.T) {
	s := natstest.Start(t, natstest.Listen())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "leasehold.yaml")
	// The file names a bucket that does not exist and a dead server; the
	// environment fixes the server; the flag fixes the bucket.
	os.WriteFile(cfg, []byte("nats: nats://127.0.0.1:1\nbucket: from-file\n"), 0o600)
	t.Setenv("NATS_URL", s.URL())
	_, err := run(t, ctx, "status", "--config", cfg)
	if err == nil || !strings.Contains(err.Error(), "from-file does not exist") {
		t.Fatalf("file's bucket with env's server: %v", err)
	}
	if _, err := coordinator.Provision(ctx, s.JetStream(t), coordinator.BucketConfig{Bucket: "from-flag", Scope: "leasehold"}); err != nil {
		t.Fatal(err)
	}
	if out, err := run(t, ctx, "status", "--config", cfg, "--bucket", "from-flag"); err != nil {
		t.Fatalf("flag over file: %v\n%s", err, out)
	}
	t.Setenv("LEASEHOLD_BUCKET", "from-env")
	if _, err := run(t, ctx, "status", "--config", cfg); err == nil || !strings.Contains(err.Error(), "from-env does not exist") {
		t.Fatalf("env over file: %v", err)
	}
	os.WriteFile(cfg, []byte("buckett: x\n"), 0o600)
	if _, err := run(t, ctx, "status", "--config", cfg); err == nil || !strings.Contains(err.Error(), `unknown setting "buckett"`) {
		t.Fatalf("misspelt setting: %v", err)
	}
	t.Setenv("LEASEHOLD_BUCKET", "")
	os.Unsetenv("LEASEHOLD_BUCKET")
	if _, err := run(t, ctx, "fence", "07"); err == nil || !strings.Contains(err.Error(), "PARTITION") {
		t.Fatalf("bad partition: %v", err)
	}
}
