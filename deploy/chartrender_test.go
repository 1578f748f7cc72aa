package deploy

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"

	"sigs.k8s.io/yaml"
)

// Rendering the Helm chart without Helm: Go's text/template, as Helm's
// engine runs it, with the few functions the chart's templates use (its
// _helpers.tpl lists them), each written here to do what Helm's or sprig's
// function of that name does. A template that calls any other function
// fails to parse, so the chart cannot come to depend on one this renderer
// does not have. Values are read and merged as Helm reads them (YAML
// numbers become float64, a user's null deletes a default) and checked
// against the chart's values.schema.json first, as Helm checks them.
// Missing map keys are errors, as under `helm lint --strict`.
//
// When a helm binary is on PATH, TestChartMatchesHelm renders the same
// value sets with it and requires the same objects.

// chartMeta is Chart.yaml, decoded strictly.
type chartMeta struct {
	APIVersion  string   `json:"apiVersion"`
	Name        string   `json:"name"`
	Description string   `json:"description"`
	Type        string   `json:"type"`
	Version     string   `json:"version"`
	AppVersion  string   `json:"appVersion"`
	KubeVersion string   `json:"kubeVersion"`
	Home        string   `json:"home"`
	Sources     []string `json:"sources"`
	Keywords    []string `json:"keywords"`
}

// helmChart is a chart directory, read.
type helmChart struct {
	dir       string
	meta      chartMeta
	values    map[string]any
	schema    map[string]any
	templates map[string]string // by Helm's template name, <chart>/templates/<file>
}

func loadChart(t *testing.T, dir string) helmChart {
	t.Helper()
	c := helmChart{dir: dir, templates: map[string]string{}}
	if err := unmarshalStrict(readFile(t, path.Join(dir, "Chart.yaml")), &c.meta); err != nil {
		t.Fatalf("%s/Chart.yaml: %v", dir, err)
	}
	if err := yaml.Unmarshal(readFile(t, path.Join(dir, "values.yaml")), &c.values); err != nil {
		t.Fatalf("%s/values.yaml: %v", dir, err)
	}
	if err := strictJSON(readFile(t, path.Join(dir, "values.schema.json")), &c.schema); err != nil {
		t.Fatalf("%s/values.schema.json: %v", dir, err)
	}
	files, err := os.ReadDir(filepath.FromSlash(path.Join(dir, "templates")))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if f.IsDir() {
			t.Fatalf("%s/templates/%s: subdirectories are not rendered by this test; add them", dir, f.Name())
		}
		c.templates[c.meta.Name+"/templates/"+f.Name()] = string(readFile(t, path.Join(dir, "templates", f.Name())))
	}
	return c
}

// helmRelease is what .Release says.
type helmRelease struct{ name, namespace string }

// values merges overrides (a values file's YAML, as `helm -f` takes it)
// over the chart's defaults.
func (c helmChart) valuesWith(overrides string) (map[string]any, error) {
	var over map[string]any
	if err := yaml.Unmarshal([]byte(overrides), &over); err != nil {
		return nil, fmt.Errorf("values: %w", err)
	}
	return coalesce(deepCopy(c.values).(map[string]any), over), nil
}

// coalesce merges over into base as Helm does: maps merge key by key,
// anything else replaces, and null deletes the key.
func coalesce(base, over map[string]any) map[string]any {
	for k, v := range over {
		if v == nil {
			delete(base, k)
			continue
		}
		if bm, ok := base[k].(map[string]any); ok {
			if om, ok := v.(map[string]any); ok {
				base[k] = coalesce(bm, om)
				continue
			}
		}
		base[k] = deepCopy(v)
	}
	return base
}

func deepCopy(v any) any {
	switch v := v.(type) {
	case map[string]any:
		m := make(map[string]any, len(v))
		for k, e := range v {
			m[k] = deepCopy(e)
		}
		return m
	case []any:
		s := make([]any, len(v))
		for i, e := range v {
			s[i] = deepCopy(e)
		}
		return s
	}
	return v
}

// render checks the values against the schema and executes every template
// but the partials (_*), as `helm template` does. It returns each
// template's output by file name; NOTES.txt is among them.
func (c helmChart) render(rel helmRelease, overrides string) (map[string]string, error) {
	values, err := c.valuesWith(overrides)
	if err != nil {
		return nil, err
	}
	if errs := validateSchema(c.schema, c.schema, values, "values"); len(errs) > 0 {
		return nil, fmt.Errorf("values don't meet the schema: %w", errors.Join(errs...))
	}
	top := map[string]any{
		"Values": values,
		"Release": map[string]any{
			"Name": rel.name, "Namespace": rel.namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Chart": map[string]any{
			"Name": c.meta.Name, "Version": c.meta.Version, "AppVersion": c.meta.AppVersion,
		},
	}
	root := template.New("gotpl").Option("missingkey=error")
	root.Funcs(helmFuncs(root))
	for _, name := range slices.Sorted(maps.Keys(c.templates)) {
		if _, err := root.New(name).Parse(c.templates[name]); err != nil {
			return nil, err
		}
	}
	out := map[string]string{}
	for _, name := range slices.Sorted(maps.Keys(c.templates)) {
		if strings.HasPrefix(path.Base(name), "_") {
			continue
		}
		var b strings.Builder
		if err := root.ExecuteTemplate(&b, name, top); err != nil {
			return nil, err
		}
		out[path.Base(name)] = b.String()
	}
	return out, nil
}

// helmFuncs are the functions the chart's templates may call, beside
// text/template's own, each as Helm or sprig defines it.
func helmFuncs(root *template.Template) template.FuncMap {
	return template.FuncMap{
		// Helm's.
		"include": func(name string, data any) (string, error) {
			var b strings.Builder
			err := root.ExecuteTemplate(&b, name, data)
			return b.String(), err
		},
		"required": func(msg string, v any) (any, error) {
			if s, ok := v.(string); v == nil || ok && s == "" {
				return v, errors.New(msg)
			}
			return v, nil
		},
		"fail": func(msg string) (string, error) { return "", errors.New(msg) },
		"toYaml": func(v any) string {
			b, err := yaml.Marshal(v)
			if err != nil {
				return ""
			}
			return strings.TrimSuffix(string(b), "\n")
		},
		// sprig's.
		"default": func(d any, given ...any) any {
			if len(given) == 0 || isEmpty(given[0]) {
				return d
			}
			return given[0]
		},
		"dict": func(kv ...any) map[string]any {
			m := map[string]any{}
			for i := 0; i < len(kv); i += 2 {
				var v any
				if i+1 < len(kv) {
					v = kv[i+1]
				}
				m[strval(kv[i])] = v
			}
			return m
		},
		"list": func(v ...any) []any { return v },
		"quote": func(v ...any) string {
			var out []string
			for _, s := range v {
				if s != nil {
					out = append(out, strconv.Quote(strval(s)))
				}
			}
			return strings.Join(out, " ")
		},
		"nindent": func(n int, s string) string { return "\n" + indent(n, s) },
		"trunc": func(n int, s string) string {
			if n >= 0 && len(s) > n {
				return s[:n]
			}
			return s
		},
		"trimSuffix": func(suffix, s string) string { return strings.TrimSuffix(s, suffix) },
		"contains":   func(sub, s string) bool { return strings.Contains(s, sub) },
		"replace":    func(old, new, s string) string { return strings.ReplaceAll(s, old, new) },
		"int":        func(v any) int { return int(toInt64(v)) },
		"add": func(v ...any) int64 {
			var sum int64
			for _, x := range v {
				sum += toInt64(x)
			}
			return sum
		},
	}
}

func indent(n int, s string) string {
	pad := strings.Repeat(" ", n)
	return pad + strings.ReplaceAll(s, "\n", "\n"+pad)
}

// strval is sprig's string conversion.
func strval(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case error:
		return v.Error()
	case fmt.Stringer:
		return v.String()
	}
	return fmt.Sprintf("%v", v)
}

// toInt64 is sprig's (spf13/cast's) integer conversion: 0 for what it
// cannot convert.
func toInt64(v any) int64 {
	switch v := v.(type) {
	case int:
		return int64(v)
	case int64:
		return v
	case int32:
		return int64(v)
	case float64:
		return int64(v)
	case bool:
		if v {
			return 1
		}
		return 0
	case string:
		n, err := strconv.ParseInt(strings.TrimSpace(v), 0, 64)
		if err != nil {
			return 0
		}
		return n
	}
	return 0
}

// isEmpty is sprig's empty: nil, false, 0, and empty strings,
// collections and maps.
func isEmpty(v any) bool {
	r := reflect.ValueOf(v)
	if !r.IsValid() {
		return true
	}
	switch r.Kind() {
	case reflect.Array, reflect.Map, reflect.Slice, reflect.String:
		return r.Len() == 0
	case reflect.Bool:
		return !r.Bool()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return r.Int() == 0
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return r.Uint() == 0
	case reflect.Float32, reflect.Float64:
		return r.Float() == 0
	case reflect.Struct:
		return false
	}
	return r.IsNil()
}
