package model

import (
	"os"
	"strings"
	"testing"
)

// outOfOrder compiles outoforder.pml: two jobs of a lease in flight at
// once, completing in either order, finals with floors, progress with a
// done set, a successor, a forger of finals under the live lease's stamp,
// and the sink's floor, proven by the fence record, and applied set.
func outOfOrder(defines ...string) verifier {
	return verifier{
		model:   "outoforder.pml",
		defines: defines,
		cflags:  []string{"-O1", "-DSAFETY", "-DCOLLAPSE", "-DMEMLIM=1024"},
		args:    []string{"-m10000"},
	}
}

// Jobs that complete out of stream order within a lease are each applied
// once committed (I8), and no chain applies a job twice; every defect put
// back gives a counterexample in which a committed job is never applied.
func TestOutOfOrderModel(t *testing.T) {
	t.Parallel()
	needTools(t)
	// Two faults of the environment, or one and the forger; the forger
	// beside two faults is the larger configuration (task model): its
	// 8 million states take minutes of a loaded machine.
	configs := []struct {
		name    string
		large   bool
		defines []string
	}{
		{"rules", false, []string{"MAXFORGE=0"}},
		{"rules-forger", false, []string{"MAXFAULTS=1"}},
		{"rules-forger-two-faults", true, nil},
	}
	large := os.Getenv(largeEnv) == "large"
	for _, c := range configs {
		if c.large && !large {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := outOfOrder(c.defines...).run(t)
			t.Logf("%s states stored, %s transitions, depth %s, %s MB, %s s", r.stored, r.transitions, r.depth, r.memory, r.elapsed)
			if r.errors != 0 {
				t.Errorf("errors: %d, want 0: %s (trail of %d steps)\n%s", r.errors, r.violation, r.trail, strings.Join(r.msc, "\n"))
			}
			if !r.complete {
				t.Errorf("the search did not cover the whole state space:\n%s", tail(r.out, 30))
			}
		})
	}
	// The defects of the worker's and the sink's rules show without the
	// forger; the rule before proven floors with it.
	for _, d := range []struct {
		variant, defect string
		forger          bool
	}{
		{"TODAY_RULE", "the sink's rule before floors: a job at or below the last applied one is a duplicate", false},
		{"DONE_ON_ACK", "a job done once its own final is acknowledged, whatever completed before it", false},
		{"NO_FLOOR", "finals without floors, the sink's floor raised to each job applied", false},
		{"TODAY_FLOOR", "the sink's floor raised by a final's floor, or its job: a forged final passes a job still running", true},
	} {
		t.Run(d.variant, func(t *testing.T) {
			t.Parallel()
			defines := []string{d.variant}
			if !d.forger {
				defines = append(defines, "MAXFORGE=0")
			} else {
				defines = append(defines, "MAXFAULTS=1")
			}
			r := outOfOrder(defines...).run(t)
			if r.errors < 1 || r.trail == 0 {
				t.Fatalf("%s: no counterexample (errors: %d, %s states)", d.defect, r.errors, r.stored)
			}
			if !strings.Contains(r.violation, "appliedKey[") {
				t.Errorf("%s: the counterexample breaks %q, want a committed job not applied (I8)\n%s", d.defect, r.violation, strings.Join(r.msc, "\n"))
			}
			t.Logf("%s: trail of %d steps: %s\n%s", d.defect, r.trail, r.violation, strings.Join(r.msc, "\n"))
		})
	}
}
