// Package examples holds runnable programs, one per directory; this test
// keeps each of them short enough to read in one sitting, and tested.
package examples

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// maxLines bounds the code of an example: all its .go files but its tests.
const maxLines = 250

func TestExamplesAreShort(t *testing.T) {
	dirs, err := filepath.Glob("*/main.go")
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) == 0 {
		t.Fatal("no examples found")
	}
	for _, m := range dirs {
		dir := filepath.Dir(m)
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		code, tests := 0, 0
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasSuffix(f, "_test.go") {
				tests++
				continue
			}
			code += bytes.Count(b, []byte("\n"))
		}
		if code >= maxLines {
			t.Errorf("%s has %d lines of code: an example shows one thing, in under %d", dir, code, maxLines)
		}
		if tests == 0 {
			t.Errorf("%s has no test that runs it", dir)
		}
	}
}
