// Package examples holds runnable programs, one per directory; this test
// keeps each of their files short enough to read in one sitting.
package examples

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// maxLines bounds a file of an example.
const maxLines = 250

func TestExampleFilesAreShort(t *testing.T) {
	files, err := filepath.Glob("*/*.go")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no example files found")
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if n := bytes.Count(b, []byte("\n")); n >= maxLines {
			t.Errorf("%s has %d lines: split it (under %d), by what each part shows", f, n, maxLines)
		}
	}
}
