package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestStatusAndFence(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	startFleet(t, s, 2, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	st := waitStatus(t, ctx, "the fleet's two members owning all partitions", func(st coordinator.Status) bool {
		owned := 0
		for _, p := range st.Partitions {
			if p.Holder != "" {
				owned++
			}
		}
		return owned == 4 && len(st.Members) == 2
	}, "--nats", s.URL())
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
	waitStatus(t, ctx, fmt.Sprintf("partition 1 re-acquired above epoch %d", before.Epoch), func(now coordinator.Status) bool {
		if len(now.Partitions) < 2 {
			return false
		}
		p := now.Partitions[1]
		return p.Holder != "" && p.Epoch > before.Epoch && p.FencedEpoch > before.Epoch
	}, "--nats", s.URL())
	out, err = run(t, ctx, "status", "--nats", s.URL())
	if err != nil || !strings.Contains(out, "PARTITION") || !strings.Contains(out, "2 live workers") {
		t.Fatalf("status table: %v\n%s", err, out)
	}
}

func TestSettingsPrecedence(t *testing.T) {
	s, ctx := listening(t, 10*time.Second)
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
