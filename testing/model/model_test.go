package model

import (
	"os"
	"strings"
	"testing"
)

// largeEnv adds the larger configurations (task model).
const largeEnv = "LEASEHOLD_MODEL"

// safety compiles a verifier for assertions and end states; memLimit (MB)
// turns running out of memory into an incomplete search, which fails the
// check, instead of the machine swapping.
func safety(memLimit string, opt string, defines ...string) verifier {
	return verifier{
		defines: defines,
		cflags:  []string{opt, "-DSAFETY", "-DMEMLIM=" + memLimit},
		args:    []string{"-m20000"},
	}
}

// progress compiles a verifier for the progress claim (leasehold.pml, ltl
// progress) under weak fairness: every enqueued job is eventually applied,
// or the runner stopped visibly. Assertions are checked too.
func progress(memLimit string, opt string, defines ...string) verifier {
	return verifier{
		defines: append([]string{"LIVENESS"}, defines...),
		cflags:  []string{opt, "-DNFAIR=3", "-DMEMLIM=" + memLimit},
		args:    []string{"-m40000", "-a", "-f"},
	}
}

// The exhaustive configurations: 2 workers, 1 partition and a named lock
// (two scopes in one lease bucket), 2 jobs (one with two effects).
// Each must search its whole state space and find nothing.
//
// The three that CI runs are compiled without optimisation: gcc -O1 takes
// about 9 s of CPU on this model's verifier, more than it saves in their
// searches (CPU seconds of gcc and pan together, -O0 against -O1:
// one-fault 10.4 and 16.4, two-faults 21.5 and 24.3, progress-one-fault
// 6.1 and 14.0). The larger ones search long enough for -O2 to pay.
var exhaustive = []struct {
	name  string
	large bool
	v     verifier
}{
	// every single fault at every step, the lock taken at any point, the
	// lease bucket's re-creation among the faults
	{"one-fault", false, safety("2048", "-O0", "MAXFAULTS=1", "MAXREC=1")},
	// every pair of faults; the lock first, one job in flight at a time
	{"two-faults", false, safety("2048", "-O0", "LOCKFIRST", "MAXFAULTS=2", "WINDOW=1")},
	{"progress-one-fault", false, progress("2048", "-O0", "LOCKFIRST", "MAXFAULTS=1")},

	// every pair of faults with two jobs in flight
	{"two-faults-window", true, safety("8192", "-O2", "LOCKFIRST", "MAXFAULTS=2")},
	{"progress-two-faults", true, progress("8192", "-O2", "LOCKFIRST", "MAXFAULTS=2", "WINDOW=1")},
}

// Both tests and all their subtests run in parallel: the exhaustive
// searches are long and single-threaded, and the defects fill the other
// core meanwhile.
func TestModel(t *testing.T) {
	t.Parallel()
	needTools(t)
	large := os.Getenv(largeEnv) == "large"
	for _, c := range exhaustive {
		if c.large && !large {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := c.v.run(t)
			t.Logf("%s: %s states stored, %s transitions, depth %s, %s MB, %s s",
				strings.Join(c.v.defines, " "), r.stored, r.transitions, r.depth, r.memory, r.elapsed)
			if r.errors != 0 {
				t.Errorf("errors: %d, want 0: %s (trail of %d steps)\n%s", r.errors, r.violation, r.trail, strings.Join(r.msc, "\n"))
			}
			if !r.complete {
				t.Errorf("the search did not cover the whole state space:\n%s", tail(r.out, 30))
			}
		})
	}
}

// Each known defect put back must give a counterexample, and for the
// property it breaks: otherwise that property has quietly become vacuous.
// want is a piece of the assertion pan reports as violated.
var defects = []struct {
	variant string
	defect  string
	want    string
}{
	{"VARIANT_A", "the runner skips a trimmed gap (I8)", "jobApplied["},
	{"VARIANT_B", "a fence keyed by partition alone (I7)", "fence[fs].setter"},
	{"VARIANT_C", "an unverified forged epoch raises a fence (I3)", "!=31"},
	{"VARIANT_D", "a redelivery judged against the current fence, refused after the barrier (I8)", "jobApplied["},
	{"VARIANT_E", "a PubAck with Duplicate=true trusted (I8)", "jobApplied["},
	{"VARIANT_F", "equal epochs admitted whatever their acquisition (I3)", "gF["},
	{"VARIANT_G", "effects applied one by one, not all or none (I8)", "appliedBy["},
	{"WRITTEN_LEASE_TOKEN", "an epoch verified by the lease record's token, which a forger can read (I8)", "jobApplied["},
	{"WRITTEN_RECENT", "the fence record keeps one recent epoch (I8)", "jobApplied["},
	{"WRITTEN_STATE", "the runner's saved state does not keep the last applied job (I8)", "jobApplied["},
	{"WRITTEN_REOPEN", "an effect of an applied job reopens an attempt (an attempt open for ever)", "slot[0].on"},
	{"TODAY_PROGRESS", "the progress record fenced and committed on the epoch alone (I2)", "frec[f].a==a"},
	{"TODAY_VERIFY", "an epoch verified by being at or below the highest fenced, whatever its acquisition (I3)", "!=31"},
	{"TODAY_MARKERS", "job markers trusted: a forged abort closes an attempt, a forged higher attempt supersedes one (I8)", "jobApplied["},
}

func TestModelDefects(t *testing.T) {
	t.Parallel()
	needTools(t)
	for _, d := range defects {
		t.Run(d.variant, func(t *testing.T) {
			t.Parallel()
			// the two-fault configuration with two jobs in flight: the
			// search stops at the first counterexample, which comes early.
			// -O0 compiles in a tenth of the time, and time goes to gcc here.
			v := safety("2048", "-O0", "LOCKFIRST", "MAXFAULTS=2", d.variant)
			r := v.run(t)
			if r.errors < 1 || r.trail == 0 {
				t.Fatalf("%s: no counterexample (errors: %d, trail of %d steps, %s states): the property it breaks is not checked",
					d.defect, r.errors, r.trail, r.stored)
			}
			if !strings.Contains(r.violation, d.want) {
				t.Errorf("%s: the counterexample breaks %q, want an assertion with %q\n%s",
					d.defect, r.violation, d.want, strings.Join(r.msc, "\n"))
			}
			t.Logf("%s: trail of %d steps (%s states stored): %s\n%s",
				d.defect, r.trail, r.stored, r.violation, strings.Join(r.msc, "\n"))
		})
	}
	// the progress claim is not vacuous: a runner that skips a gap never
	// applies the trimmed jobs, and (assertions off) the claim alone finds it
	t.Run("progress-VARIANT_A", func(t *testing.T) {
		t.Parallel()
		v := progress("2048", "-O0", "LOCKFIRST", "MAXFAULTS=1", "VARIANT_A")
		v.args = append(v.args, "-A")
		r := v.run(t)
		if r.errors < 1 || r.trail == 0 || !strings.Contains(r.violation, "acceptance cycle") {
			t.Fatalf("the progress claim found no cycle where the runner skips a gap (errors: %d, %s)", r.errors, r.violation)
		}
		t.Logf("progress claim: trail of %d steps (%s states stored): %s", r.trail, r.stored, r.violation)
	})
}
