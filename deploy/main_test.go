// Package deploy holds leasehold's deployment files: Kubernetes manifests,
// values for the NATS Helm chart, a KEDA ScaledObject, a docker-compose
// setup and nats-server configuration with least-privilege users. It has no
// Go code of its own; its tests check every file offline, so that CI fails
// on a misspelt field, a probe on the wrong port, a grace period shorter
// than the drain, a flag the leasehold command does not have, or NATS
// permissions that leasehold's lease code cannot work with.
package deploy

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testskip"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(testskip.Summarize(m)) }

// readFile reads a file of this directory (tests run in it).
func readFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.FromSlash(name))
	if err != nil {
		t.Fatalf("read %s: %v", name, err)
	}
	return b
}

// yamlFiles lists the .yaml files of dir, sorted.
func yamlFiles(t *testing.T, dir string) []string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(filepath.FromSlash(dir), "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(names) == 0 {
		t.Fatalf("no .yaml files in %s", dir)
	}
	sort.Strings(names)
	for i, n := range names {
		names[i] = filepath.ToSlash(n)
	}
	return names
}

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// splitDocuments splits a multi-document YAML file on its "---" lines and
// drops documents that hold only comments or blank lines.
func splitDocuments(b []byte) [][]byte {
	var docs [][]byte
	for _, d := range docSeparator.Split(string(b), -1) {
		if hasContent(d) {
			docs = append(docs, []byte(d))
		}
	}
	return docs
}

func hasContent(doc string) bool {
	for _, line := range strings.Split(doc, "\n") {
		line = strings.TrimSpace(line)
		if line != "" && !strings.HasPrefix(line, "#") {
			return true
		}
	}
	return false
}

// mutate returns b with the first occurrence of old replaced, failing the
// test when old is not there (so a mutation test cannot pass vacuously).
func mutate(t *testing.T, b []byte, old, new string) []byte {
	t.Helper()
	if !bytes.Contains(b, []byte(old)) {
		t.Fatalf("mutation: %q is not in the file", old)
	}
	return bytes.Replace(b, []byte(old), []byte(new), 1)
}

// unmarshalStrict decodes YAML into v the way a strict Kubernetes API
// server does: field names match case-sensitively, and an unknown or
// duplicated field is an error. (encoding/json, under sigs.k8s.io/yaml's
// UnmarshalStrict, would take "readOnlyRootFileSystem" for
// "readOnlyRootFilesystem".)
func unmarshalStrict(doc []byte, v any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strict, err := kjson.UnmarshalStrict(j, v, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}
