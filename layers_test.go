package leasehold_test

import (
	"bufio"
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// floors are the layers of the module, lowest first, each named by the
// folders that hold it (see the package doc). A package may import its
// own floor and the ones below it, never one above.
var floors = []struct {
	name     string
	prefixes []string
}{
	{"vocabulary", []string{""}},
	{"helpers", []string{"internal/"}},
	{"coordinator", []string{"coordinator"}},
	{"telemetry", []string{"telemetry"}},
	{"sinks", []string{"sink"}},
	{"worker", []string{"worker"}},
	{"tools", []string{"statuspage", "testing/", "cmd/leasehold/internal/"}},
	{"programs", []string{"cmd/", "examples", "deploy"}},
}

const module = "github.com/leasehold/leasehold"

// floorOf is the index in floors of the package at path (relative to the
// module), or -1 when it is outside the module. The longest prefix wins,
// so cmd/leasehold/internal/bench is a tool, not a program.
func floorOf(path string) int {
	best, bestLen := -1, -1
	for i, f := range floors {
		for _, p := range f.prefixes {
			match := path == p || p == "" && path == "" ||
				p != "" && (strings.HasPrefix(path, p) && (strings.HasSuffix(p, "/") || len(path) == len(p) || path[len(p)] == '/'))
			if match && len(p) > bestLen {
				best, bestLen = i, len(p)
			}
		}
	}
	return best
}

// TestLayers reads every package's imports with `go list` and fails on
// an import that runs up the floors.
func TestLayers(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", "./...").Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go list: %v\n%s", err, stderr)
	}
	rel := func(p string) (string, bool) {
		if p == module {
			return "", true
		}
		r, ok := strings.CutPrefix(p, module+"/")
		return r, ok
	}
	seen := 0
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		from, _ := rel(fields[0])
		ff := floorOf(from)
		if ff < 0 {
			t.Errorf("package %s sits in no floor: add its folder to floors and to the package doc", fields[0])
			continue
		}
		seen++
		for _, imp := range fields[1:] {
			to, ok := rel(imp)
			if !ok {
				continue
			}
			if tf := floorOf(to); tf > ff {
				t.Errorf("%s (%s) imports %s (%s): an arrow that runs up the layers", fields[0], floors[ff].name, imp, floors[tf].name)
			}
		}
	}
	if seen < 10 {
		t.Fatalf("go list showed %d packages of the module", seen)
	}
}

func TestFloorOf(t *testing.T) {
	for path, want := range map[string]string{
		"":                             "vocabulary",
		"internal/retry":               "helpers",
		"coordinator":                  "coordinator",
		"telemetry":                    "telemetry",
		"sink":                         "sinks",
		"sink/streamsink":              "sinks",
		"worker/wmstamp":               "worker",
		"statuspage":                   "tools",
		"testing/chaos":                "tools",
		"cmd/leasehold/internal/bench": "tools",
		"cmd/leasehold":                "programs",
		"examples/quickstart":          "programs",
		"deploy":                       "programs",
	} {
		if got := floorOf(path); got < 0 || floors[got].name != want {
			t.Errorf("floorOf(%q) = %d, want %s", path, got, want)
		}
	}
	if got := floorOf("sinkhole"); got >= 0 && floors[got].name == "sinks" {
		t.Errorf("sinkhole counted among the sinks")
	}
}

// maxLines bounds a Go file's length: past it, a file holds more than one
// concept, and should be split by them.
const maxLines = 600

// No Go file of the module is longer than maxLines.
func TestFileLengths(t *testing.T) {
	seen := 0
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		seen++
		if n := bytes.Count(b, []byte("\n")); n > maxLines {
			t.Errorf("%s has %d lines, more than %d: split it by concept", path, n, maxLines)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen < 100 {
		t.Fatalf("found %d Go files", seen)
	}
}
