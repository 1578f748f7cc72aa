package deploy

import (
	"fmt"
	"math"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"
)

// The schema is read with sigs.k8s.io/json, which gives integers as int64;
// number reads both.

// validateSchema checks v against the JSON Schema (draft 07) s, for the
// keywords the chart's values.schema.json uses: $ref to #/definitions,
// type, properties, additionalProperties, required, items, enum, minimum,
// maximum, exclusiveMinimum, minLength and pattern. A keyword it does not
// know is an error, so the schema cannot use one this check would ignore.
// root is the whole schema, for $ref; where names the value in errors.
func validateSchema(root, s map[string]any, v any, where string) []error {
	var errs []error
	fail := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: "+format, append([]any{where}, args...)...))
	}
	if ref, ok := s["$ref"].(string); ok {
		name, ok := strings.CutPrefix(ref, "#/definitions/")
		def, _ := root["definitions"].(map[string]any)[name].(map[string]any)
		if !ok || def == nil {
			fail("schema $ref %q: no such definition", ref)
			return errs
		}
		return validateSchema(root, def, v, where)
	}
	for k := range s {
		switch k {
		case "$schema", "title", "description", "definitions", "type", "properties", "additionalProperties",
			"required", "items", "enum", "minimum", "maximum", "exclusiveMinimum", "minLength", "pattern":
		default:
			fail("schema keyword %q is not checked by this test; teach validateSchema", k)
		}
	}
	if t, ok := s["type"]; ok {
		var types []string
		switch t := t.(type) {
		case string:
			types = []string{t}
		case []any:
			for _, e := range t {
				types = append(types, e.(string))
			}
		}
		if !slices.ContainsFunc(types, func(t string) bool { return hasType(v, t) }) {
			fail("%s, want %s", describe(v), strings.Join(types, " or "))
			return errs
		}
	}
	if enum, ok := s["enum"].([]any); ok && !slices.ContainsFunc(enum, func(e any) bool { return sameJSON(e, v) }) {
		fail("%v is not one of %v", v, enum)
	}
	if n, ok := number(v); ok {
		if m, ok := number(s["minimum"]); ok && n < m {
			fail("%v is below the minimum %v", n, m)
		}
		if m, ok := number(s["maximum"]); ok && n > m {
			fail("%v is above the maximum %v", n, m)
		}
		if m, ok := number(s["exclusiveMinimum"]); ok && n <= m {
			fail("%v is not above %v", n, m)
		}
	}
	if str, ok := v.(string); ok {
		if m, ok := number(s["minLength"]); ok && float64(utf8.RuneCountInString(str)) < m {
			fail("%q is shorter than %v", str, m)
		}
		if p, ok := s["pattern"].(string); ok && !regexp.MustCompile(p).MatchString(str) {
			fail("%q does not match %s", str, p)
		}
	}
	if arr, ok := v.([]any); ok {
		if items, ok := s["items"].(map[string]any); ok {
			for i, e := range arr {
				errs = append(errs, validateSchema(root, items, e, fmt.Sprintf("%s[%d]", where, i))...)
			}
		}
	}
	if obj, ok := v.(map[string]any); ok {
		props, _ := s["properties"].(map[string]any)
		required, _ := s["required"].([]any)
		for _, r := range required {
			if _, ok := obj[r.(string)]; !ok {
				fail("%s is required", r)
			}
		}
		for k, e := range obj {
			if ps, ok := props[k].(map[string]any); ok {
				errs = append(errs, validateSchema(root, ps, e, where+"."+k)...)
				continue
			}
			switch ap := s["additionalProperties"].(type) {
			case bool:
				if !ap {
					fail("%s is not a key of the chart's values (a misspelling?)", k)
				}
			case map[string]any:
				errs = append(errs, validateSchema(root, ap, e, where+"."+k)...)
			}
		}
	}
	return errs
}

func hasType(v any, t string) bool {
	switch t {
	case "object":
		_, ok := v.(map[string]any)
		return ok
	case "array":
		_, ok := v.([]any)
		return ok
	case "string":
		_, ok := v.(string)
		return ok
	case "boolean":
		_, ok := v.(bool)
		return ok
	case "null":
		return v == nil
	case "number":
		_, ok := number(v)
		return ok
	case "integer":
		n, ok := number(v)
		return ok && n == math.Trunc(n)
	}
	return false
}

// number is v as a float64, if it is a number (YAML gives float64, --set
// int64).
func number(v any) (float64, bool) {
	switch n := v.(type) {
	case float64:
		return n, true
	case int:
		return float64(n), true
	case int64:
		return float64(n), true
	}
	return 0, false
}

func sameJSON(a, b any) bool {
	if x, ok := number(a); ok {
		y, ok := number(b)
		return ok && x == y
	}
	return reflect.DeepEqual(a, b)
}

func describe(v any) string {
	if v == nil {
		return "null"
	}
	return fmt.Sprintf("%v (%T)", v, v)
}
