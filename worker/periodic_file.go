package worker

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"sigs.k8s.io/yaml"
)

// MaxPeriodicFile bounds the size of a file ParsePeriodics reads.
const MaxPeriodicFile = 1 << 20

// periodicFile is the YAML (or JSON) form of periodic jobs:
//
//	periodic:
//	  - name: sweep          # default: the kind
//	    kind: sweep
//	    every: 1m            # or cron: "0 0 3 * * *" (seconds first), timezone: Europe/Paris
//	    payload: {older_than: 24h}
//	    key: sweep           # picks the partition; default: the name
type periodicFile struct {
	Periodic []periodicEntry `json:"periodic"`
}

type periodicEntry struct {
	Name     string          `json:"name"`
	Kind     string          `json:"kind"`
	Every    string          `json:"every"`
	Cron     string          `json:"cron"`
	TimeZone string          `json:"timezone"`
	Payload  json.RawMessage `json:"payload"`
	Key      string          `json:"key"`
}

// ParsePeriodics reads periodic jobs declared in YAML or JSON (see the
// example in the package documentation and in docs/jobs.md). Unknown fields
// are errors, every entry is validated as Producer.Schedule would, names
// must be unique, and each payload is kept as the JSON it was written as,
// so a handler registered with Handle for a JSON type decodes it. Every
// problem is reported at once, with the entry's index and name.
func ParsePeriodics(data []byte) ([]Periodic, error) {
	if len(data) > MaxPeriodicFile {
		return nil, fmt.Errorf("worker: periodic jobs: %d bytes, more than %d", len(data), MaxPeriodicFile)
	}
	var f periodicFile
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, fmt.Errorf("worker: periodic jobs: %w", err)
	}
	var (
		out  []Periodic
		errs []error
		seen = map[string]int{}
	)
	for i, e := range f.Periodic {
		pj := Periodic{Name: e.Name, Kind: e.Kind, Cron: e.Cron, TimeZone: e.TimeZone, Codec: JSONCodec}
		what := fmt.Sprintf("periodic job %d", i+1)
		if e.Name != "" || e.Kind != "" {
			what = fmt.Sprintf("periodic job %d (%s)", i+1, cmp.Or(e.Name, e.Kind))
		}
		if e.Every != "" {
			d, err := time.ParseDuration(e.Every)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: every %q: %w", what, e.Every, err))
				continue
			}
			pj.Every = d
		}
		if p := bytes.TrimSpace(e.Payload); len(p) > 0 && !bytes.Equal(p, []byte("null")) {
			pj.Payload = json.RawMessage(p)
		}
		if e.Key != "" {
			pj.Key = []byte(e.Key)
		}
		if err := pj.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", what, err))
			continue
		}
		name := cmp.Or(pj.Name, pj.Kind)
		if j, dup := seen[name]; dup {
			errs = append(errs, fmt.Errorf("%s: the name %q is also periodic job %d's", what, name, j))
			continue
		}
		seen[name] = i + 1
		out = append(out, pj)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("worker: periodic jobs: %w", errors.Join(errs...))
	}
	return out, nil
}
