package leasehold_test

import (
	"testing"

	"github.com/leasehold/leasehold"
)

// TestEffectKeyAllocations: an effect's key costs one allocation, the
// string itself.
func TestEffectKeyAllocations(t *testing.T) {
	if got := leasehold.EffectKey("orders", 7, 123456, 0); got != "orders.7.123456.0" {
		t.Fatalf("EffectKey = %q", got)
	}
	if n := testing.AllocsPerRun(100, func() { _ = leasehold.EffectKey("orders", 7, 123456, 0) }); n != 1 {
		t.Fatalf("EffectKey took %v allocations", n)
	}
}
