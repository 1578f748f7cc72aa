package model

import (
	"bufio"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/internal/testskip"
)

// requireEnv names the environment variable that turns a missing spin or
// gcc from a skip into a failure (CI sets it).
const requireEnv = "LEASEHOLD_REQUIRE_SPIN"

// needTools skips the test when spin or gcc is missing, or fails it when
// the environment requires them.
func needTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"spin", "gcc"} {
		if _, err := exec.LookPath(tool); err != nil {
			msg := tool + " is not on PATH: the model is not checked (Debian packages spin and gcc)"
			if os.Getenv(requireEnv) == "1" {
				t.Fatalf("%s, and %s=1 requires it", msg, requireEnv)
			}
			testskip.Skip(t, testskip.SPIN, msg+"; set "+requireEnv+"=1 to fail instead")
		}
	}
}

// verifier is one configuration of the model compiled into a SPIN
// verifier: spin -a with the defines, gcc with the flags, pan with the args.
type verifier struct {
	model   string   // the model's main file; default leasehold.pml
	defines []string // sizes and switches (leasehold.pml)
	cflags  []string // -DSAFETY, -DMEMLIM=..., -DNFAIR=...
	args    []string // pan: -m depth, -a -f for the progress claim
}

// result is what pan reported.
type result struct {
	out         string
	errors      int
	complete    bool   // the whole state space was searched
	stored      string // states stored
	transitions string
	depth       string
	memory      string // total actual memory usage, MB
	elapsed     string // seconds, as pan measured them
	violation   string // the first error pan reported
	trail       int    // steps of the counterexample; 0 without one
	msc         []string
}

var (
	reErrors      = regexp.MustCompile(`depth reached (\d+), errors: (\d+)`)
	reStored      = regexp.MustCompile(`(?m)^\s*(\S+) states, stored`)
	reTransitions = regexp.MustCompile(`(?m)^\s*(\S+) transitions \(`)
	reMemory      = regexp.MustCompile(`(?m)^\s*(\S+)\s+total actual memory usage`)
	reElapsed     = regexp.MustCompile(`pan: elapsed time (\S+) seconds`)
	reViolation   = regexp.MustCompile(`(?m)^pan:1: (.*)$`)
)

// incomplete are pan's words for a search that did not cover the state
// space; an exhaustive check must print none of them.
var incomplete = []string{"Search not completed", "max search depth too small", "reached -DMEMLIM bound"}

// run generates, compiles and runs the verifier in a directory of its own.
// A counterexample is replayed (spin -t) for its MSC lines, so that a
// failing variant's log reads as the steps of the protocol.
func (v verifier) run(t *testing.T) result {
	t.Helper()
	dir := t.TempDir()
	sources, err := filepath.Glob("*.pml")
	if err != nil || len(sources) == 0 {
		t.Fatalf("no model sources beside the test: %v", err)
	}
	for _, src := range sources {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, src), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	defs := make([]string, 0, len(v.defines))
	for _, d := range v.defines {
		defs = append(defs, "-D"+d)
	}
	model := v.model
	if model == "" {
		model = "leasehold.pml"
	}
	v.cmd(t, dir, "spin", append(append([]string{"-a"}, defs...), model)...)
	v.cmd(t, dir, "gcc", append(append([]string{}, v.cflags...), "-o", "pan", "pan.c")...)

	// pan exits non-zero when it finds an error: that is read from its
	// output, not from its status.
	pan := exec.CommandContext(t.Context(), "./pan", v.args...)
	pan.Dir = dir
	outb, err := pan.CombinedOutput()
	out := string(outb)
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("pan: %v", err)
	}
	r := parse(t, out)
	if trail := filepath.Join(dir, model+".trail"); fileExists(trail) {
		r.trail = trailSteps(t, trail)
		replay := v.cmd(t, dir, "spin", append(append([]string{"-t"}, defs...), model)...)
		for _, line := range strings.Split(replay, "\n") {
			if s := strings.TrimSpace(line); strings.HasPrefix(s, "MSC:") || strings.Contains(s, "violated") || strings.Contains(s, "START OF CYCLE") {
				r.msc = append(r.msc, s)
			}
		}
	}
	return r
}

func (v verifier) cmd(t *testing.T, dir, name string, args ...string) string {
	t.Helper()
	c := exec.CommandContext(t.Context(), name, args...)
	c.Dir = dir
	out, err := c.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, tail(string(out), 40))
	}
	return string(out)
}

func parse(t *testing.T, out string) result {
	t.Helper()
	r := result{out: out}
	m := reErrors.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("pan printed no error count:\n%s", tail(out, 40))
	}
	r.depth = m[1]
	r.errors, _ = strconv.Atoi(m[2])
	r.complete = true
	for _, w := range incomplete {
		if strings.Contains(out, w) {
			r.complete = false
		}
	}
	r.stored = first(reStored, out)
	r.transitions = first(reTransitions, out)
	r.memory = first(reMemory, out)
	r.elapsed = first(reElapsed, out)
	r.violation = first(reViolation, out)
	return r
}

func first(re *regexp.Regexp, s string) string {
	if m := re.FindStringSubmatch(s); m != nil {
		return m[1]
	}
	return ""
}

// trailSteps counts the steps of a trail: lines "step:proc:transition"
// with a step of 0 or more (negative ones mark the claim and the cycle).
func trailSteps(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		step, _, ok := strings.Cut(sc.Text(), ":")
		if i, err := strconv.Atoi(step); ok && err == nil && i >= 0 {
			n++
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func tail(s string, lines int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}
