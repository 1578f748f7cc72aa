package worker_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

func TestParsePeriodics(t *testing.T) {
	jobs, err := worker.ParsePeriodics([]byte(`
periodic:
  - name: sweep
    kind: sweep
    every: 90s
    payload: {older_than: 24h, limit: 10}
  - kind: report
    cron: "@daily"
    timezone: Europe/Paris
    key: reports
`))
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 2 {
		t.Fatalf("%d periodic jobs, want 2", len(jobs))
	}
	sweep, report := jobs[0], jobs[1]
	if sweep.Name != "sweep" || sweep.Kind != "sweep" || sweep.Every != 90*time.Second || sweep.Cron != "" {
		t.Errorf("sweep: %+v", sweep)
	}
	raw, ok := sweep.Payload.(json.RawMessage)
	if !ok {
		t.Fatalf("sweep's payload is %T, want the JSON it was written as", sweep.Payload)
	}
	var p struct {
		OlderThan string `json:"older_than"`
		Limit     int    `json:"limit"`
	}
	if err := json.Unmarshal(raw, &p); err != nil || p.OlderThan != "24h" || p.Limit != 10 {
		t.Errorf("sweep's payload %s decodes to %+v (%v)", raw, p, err)
	}
	if report.Kind != "report" || report.Cron != "@daily" || report.TimeZone != "Europe/Paris" || string(report.Key) != "reports" || report.Payload != nil {
		t.Errorf("report: %+v", report)
	}

	for _, c := range []struct{ name, doc, want string }{
		{"unknown field", "periodic:\n  - kind: a\n    evry: 1m\n", "evry"},
		{"bad duration", "periodic:\n  - kind: a\n    every: soon\n", `every "soon"`},
		{"both every and cron", "periodic:\n  - kind: a\n    every: 1m\n    cron: \"@daily\"\n", "periodic job 1 (a)"},
		{"neither", "periodic:\n  - kind: a\n", "periodic job 1 (a)"},
		{"bad kind", "periodic:\n  - kind: \"a b\"\n    every: 1m\n", "periodic job 1"},
		{"under a second", "periodic:\n  - kind: a\n    every: 10ms\n", "periodic job 1 (a)"},
		{"duplicate names", "periodic:\n  - kind: a\n    every: 1m\n  - name: a\n    kind: b\n    every: 1m\n", `the name "a" is also periodic job 1's`},
		{"not YAML", "periodic: [", "periodic jobs"},
		{"too large", "periodic: []\n" + strings.Repeat("#", worker.MaxPeriodicFile), "more than"},
	} {
		_, err := worker.ParsePeriodics([]byte(c.doc))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error naming %q", c.name, err, c.want)
		}
	}
	// Every problem at once.
	_, err = worker.ParsePeriodics([]byte("periodic:\n  - kind: a\n    every: x\n  - kind: b\n"))
	if err == nil || !strings.Contains(err.Error(), "periodic job 1") || !strings.Contains(err.Error(), "periodic job 2") {
		t.Errorf("two bad entries: %v, want both named", err)
	}
}
