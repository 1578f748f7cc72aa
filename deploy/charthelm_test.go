package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/leasehold/leasehold/internal/testskip"
)

// helmNeed is what TestChartMatchesHelm skips without: a helm binary,
// which the Go module proxy serves as source.
var helmNeed = testskip.Need{Missing: "helm not found", Install: "go install helm.sh/helm/v4/cmd/helm@v4.3.2"}

// helmBinary is $LEASEHOLD_HELM, or helm on PATH, or "".
func helmBinary() string {
	if p := os.Getenv("LEASEHOLD_HELM"); p != "" {
		return p
	}
	p, _ := exec.LookPath("helm")
	return p
}

// TestChartMatchesHelm renders every value set with Helm itself and
// requires the objects this package's renderer makes, field by field; the
// values the chart refuses, Helm must refuse too; and `helm lint --strict`
// passes. It shows that the offline renderer renders what Helm does.
func TestChartMatchesHelm(t *testing.T) {
	t.Parallel()
	helm := helmBinary()
	if helm == "" {
		testskip.Skip(t, helmNeed, "no helm on PATH or in $LEASEHOLD_HELM: the chart was rendered by this package's renderer only")
	}
	c := loadChart(t, chartDir)
	dir := t.TempDir()
	run := func(t *testing.T, values string, args ...string) ([]byte, error) {
		t.Helper()
		f := filepath.Join(dir, "values.yaml")
		if err := os.WriteFile(f, []byte(values), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(helm, append(args, "-f", f)...)
		// Helm keeps its caches and settings apart from the user's.
		cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+dir+"/cache", "HELM_CONFIG_HOME="+dir+"/config", "HELM_DATA_HOME="+dir+"/data")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return out, fmt.Errorf("%v: %s", err, stderr.Bytes())
		}
		return out, nil
	}
	for _, vs := range chartValueSets {
		t.Run(vs.name, func(t *testing.T) {
			out, err := run(t, vs.values, "template", vs.rel.name, chartDir, "--namespace", vs.rel.namespace, "--kube-version", "1.30.0")
			if err != nil {
				t.Fatalf("helm template: %v", err)
			}
			theirs, err := objectsByName(splitDocuments(out))
			if err != nil {
				t.Fatalf("helm's output: %v", err)
			}
			files, err := c.render(vs.rel, vs.values)
			if err != nil {
				t.Fatal(err)
			}
			var docs [][]byte
			for name, f := range files {
				if name != "NOTES.txt" {
					docs = append(docs, splitDocuments([]byte(f))...)
				}
			}
			ours, err := objectsByName(docs)
			if err != nil {
				t.Fatal(err)
			}
			for _, k := range sortedKeys(theirs) {
				if _, ok := ours[k]; !ok {
					t.Errorf("helm renders %s, this package's renderer does not", k)
				}
			}
			for _, k := range sortedKeys(ours) {
				o, ok := theirs[k]
				if !ok {
					t.Errorf("this package's renderer renders %s, helm does not", k)
					continue
				}
				if !reflect.DeepEqual(ours[k], o) {
					a, _ := yaml.Marshal(ours[k])
					b, _ := yaml.Marshal(o)
					t.Errorf("%s differs.\nthis package's renderer:\n%s\nhelm:\n%s", k, a, b)
				}
			}
			if _, err := run(t, vs.values, "lint", "--strict", chartDir, "--namespace", vs.rel.namespace); err != nil {
				t.Errorf("helm lint --strict: %v", err)
			}
		})
	}
	for _, r := range chartRefusals {
		t.Run("refuses/"+r.name, func(t *testing.T) {
			if _, err := run(t, r.values, "template", "leasehold", chartDir, "--namespace", "leasehold", "--kube-version", "1.30.0"); err == nil {
				t.Fatalf("helm rendered %q, which this package's renderer refuses", r.values)
			} else {
				t.Logf("helm refused it too: %v", err)
			}
		})
	}
}

// objectsByName decodes YAML documents into JSON values keyed by
// apiVersion, kind, namespace and name; documents of comments only are
// left out.
func objectsByName(docs [][]byte) (map[string]any, error) {
	out := map[string]any{}
	for _, d := range docs {
		if !hasContent(string(d)) {
			continue
		}
		j, err := yaml.YAMLToJSON(d)
		if err != nil {
			return nil, err
		}
		var obj struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name, Namespace string
			} `json:"metadata"`
		}
		var v any
		if err := json.Unmarshal(j, &obj); err != nil {
			return nil, err
		}
		if err := json.Unmarshal(j, &v); err != nil {
			return nil, err
		}
		k := obj.APIVersion + "/" + obj.Kind + " " + obj.Metadata.Namespace + "/" + obj.Metadata.Name
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("%s rendered twice", k)
		}
		out[k] = v
	}
	return out, nil
}
