package chaos

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestConfigSaysWhatToFix(t *testing.T) {
	err := Config{Workers: 1, TTL: 1500 * time.Millisecond, Faults: []string{"meteor"}, Rate: -1, PartitionConcurrency: 300}.Validate()
	for _, want := range []string{"workers 1", "whole seconds", `fault "meteor"`, "rate -1", "partition concurrency 300"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not mention %q", err, want)
		}
	}
	if err := (Config{}).Validate(); err != nil {
		t.Fatalf("the defaults: %v", err)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "old.jsonl"), []byte("{}\n"), 0o644)
	if _, err := Run(context.Background(), Config{Dir: dir}); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Fatalf("a used directory: %v", err)
	}
}
