package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// --pack-effects, from the command line or LEASEHOLD_PACK_EFFECTS, is
// refused with the legacy stamp before the worker connects.
func TestWorkerPackEffectsNeedsCompactStamp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	base := []string{"worker", "--nats", "nats://127.0.0.1:1", "--http", "", "--stamp-format", "legacy"}
	if _, err := run(t, ctx, append(base, "--pack-effects")...); err == nil || !strings.Contains(err.Error(), "--pack-effects") {
		t.Errorf("--pack-effects --stamp-format legacy: %v, want an error naming --pack-effects", err)
	}
	t.Setenv("LEASEHOLD_PACK_EFFECTS", "true")
	if _, err := run(t, ctx, base...); err == nil || !strings.Contains(err.Error(), "--pack-effects") {
		t.Errorf("LEASEHOLD_PACK_EFFECTS=true --stamp-format legacy: %v, want an error naming --pack-effects", err)
	}
}
