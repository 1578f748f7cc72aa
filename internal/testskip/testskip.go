// Package testskip records the tests that skip because the machine lacks
// something they need (PostgreSQL, Chromium, SPIN, root for network
// namespaces) and, when a package's tests end, prints one line per missing
// thing naming how many tests it cost and the command that installs it:
//
//	leasehold: sink/pgsink: 12 tests skipped: PostgreSQL's initdb not found; apt-get install postgresql
//
// A package opts in from its TestMain, around whatever it already does:
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(testskip.Summarize(m)) }
//
// and a test skips with Skip instead of t.Skip.
//
// The line must be seen without -v. `go test ./pkg` keeps a passing
// package's output to itself and prints only its "ok" line. So when the go
// command runs the test binary, not verbose, and buffers its output, the
// line goes to the go command's own standard output instead, just before
// the package's "ok" line: through a copy of the go command's descriptor
// (pidfd_getfd, Linux), or where the kernel refuses that, opened anew
// through /proc when it is a terminal or a pipe. Everywhere else (-v,
// -json, `go test` in the package's directory, the binary run by hand) it
// goes to the test binary's standard output.
//
// Import it from tests only.
package testskip

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
)

// Need is something tests need that a machine may lack.
type Need struct {
	// Missing says what is missing, as the summary names it.
	Missing string
	// Install is the command that provides it.
	Install string
}

// The needs of leasehold's tests, as CI installs them (.ci/run).
var (
	PostgreSQL = Need{Missing: "PostgreSQL's initdb not found", Install: "apt-get install postgresql"}
	Chromium   = Need{Missing: "Chromium not found", Install: "apt-get install chromium"}
	SPIN       = Need{Missing: "spin or gcc not found", Install: "apt-get install spin gcc"}
	NetNS      = Need{Missing: "no network partitions (they need root, ip and nft)", Install: "run as root after apt-get install iproute2 nftables"}
)

// gap is what the package's tests did without one need.
type gap struct {
	need    Need
	skipped map[string]struct{} // names of the tests that skipped
	partial map[string]struct{} // names of the tests that ran without it
}

var (
	mu   sync.Mutex
	gaps = map[string]*gap{}
)

func record(n Need, test string, skipped bool) {
	mu.Lock()
	defer mu.Unlock()
	g := gaps[n.Missing]
	if g == nil {
		g = &gap{need: n, skipped: map[string]struct{}{}, partial: map[string]struct{}{}}
		gaps[n.Missing] = g
	}
	if skipped {
		g.skipped[test] = struct{}{}
	} else {
		g.partial[test] = struct{}{}
	}
}

// Skip records that tb skips for want of n, and skips it with msg.
func Skip(tb testing.TB, n Need, msg string) {
	tb.Helper()
	record(n, tb.Name(), true)
	tb.Skip(msg)
}

// Partial records that tb ran but left out a part that needs n, and logs
// msg.
func Partial(tb testing.TB, n Need, msg string) {
	tb.Helper()
	record(n, tb.Name(), false)
	tb.Log(msg)
}

// TestingM is what a TestMain runs: *testing.M, or a wrapper of it (as
// goleak.VerifyTestMain takes).
type TestingM interface{ Run() int }

type summarizing struct{ m TestingM }

// Summarize returns m, whose Run also prints the summary once the tests
// have run.
func Summarize(m TestingM) TestingM { return summarizing{m} }

func (s summarizing) Run() int {
	code := s.m.Run()
	if lines := Summary(); len(lines) > 0 {
		w, closeW := out()
		for _, l := range lines {
			fmt.Fprintln(w, l)
		}
		closeW()
	}
	return code
}

// Summary returns the lines Summarize prints: one per need that cost a
// test, for the package in the working directory.
func Summary() []string {
	mu.Lock()
	defer mu.Unlock()
	names := make([]string, 0, len(gaps))
	for name := range gaps {
		names = append(names, name)
	}
	sort.Strings(names)
	pkg := packagePath()
	var lines []string
	for _, name := range names {
		g := gaps[name]
		if n := len(g.skipped); n > 0 {
			lines = append(lines, fmt.Sprintf("leasehold: %s: %s skipped: %s; %s", pkg, tests(n), g.need.Missing, g.need.Install))
		}
		if n := len(g.partial); n > 0 {
			lines = append(lines, fmt.Sprintf("leasehold: %s: %s ran in part: %s; %s", pkg, tests(n), g.need.Missing, g.need.Install))
		}
	}
	return lines
}

func tests(n int) string {
	if n == 1 {
		return "1 test"
	}
	return fmt.Sprintf("%d tests", n)
}

// packagePath names the package under test by its directory (go test
// runs a test binary there), relative to the module's root.
func packagePath() string {
	wd, err := os.Getwd()
	if err != nil {
		return "?"
	}
	for dir := wd; ; {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			rel, err := filepath.Rel(dir, wd)
			if err != nil || rel == "." {
				return filepath.Base(wd)
			}
			return filepath.ToSlash(rel)
		}
		up := filepath.Dir(dir)
		if up == dir {
			return filepath.Base(wd)
		}
		dir = up
	}
}

// out is where the summary goes: the go command's standard output when
// the go command would otherwise swallow it, else this binary's.
func out() (io.Writer, func()) {
	if testing.Verbose() {
		return os.Stdout, func() {}
	}
	if f := goCommandStdout(); f != nil {
		return f, func() { f.Close() }
	}
	return os.Stdout, func() {}
}

// goCommandStdout returns the standard output of the go command that
// runs this binary, when this binary's own output does not reach it
// directly; nil otherwise.
func goCommandStdout() *os.File {
	ppid := os.Getppid()
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", ppid))
	if err != nil || strings.TrimSuffix(filepath.Base(exe), ".exe") != "go" {
		return nil
	}
	path := fmt.Sprintf("/proc/%d/fd/1", ppid)
	theirs, err := os.Stat(path)
	if err != nil {
		return nil
	}
	if ours, err := os.Stdout.Stat(); err == nil && os.SameFile(ours, theirs) {
		return nil // the go command streams this binary's output as it is
	}
	if f := dupFD(ppid, 1); f != nil {
		return f
	}
	// Without a copy of the descriptor, a terminal or a pipe can be
	// opened anew; a regular file cannot, as it would be written at
	// another offset than the go command's.
	if theirs.Mode()&(os.ModeCharDevice|os.ModeNamedPipe) == 0 {
		return nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return nil
	}
	return f
}
