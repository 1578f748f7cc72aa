package deploy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

// exportedSeries records into every instrument leasehold defines, through
// the real OpenTelemetry Prometheus exporter leasehold processes serve
// /metrics with, and returns each series name it exports with the label
// names seen on it. The instruments are found by reflection over
// telemetry.Metrics, so that a new one is checked without this test
// knowing its name; the gauges, the refusals by scope (from a real stale
// write refused by the memory sink) and the status page's drop counter
// come from the code that records them.
func exportedSeries(t *testing.T) map[string]map[string]bool {
	t.Helper()
	ctx := context.Background()
	mp, handler, err := telemetry.NewPrometheus()
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Shutdown(ctx)
	tel := telemetry.New(telemetry.Config{MeterProvider: mp})
	m := reflect.ValueOf(tel.Metrics).Elem()
	for i := range m.NumField() {
		f := m.Type().Field(i)
		if !f.IsExported() {
			continue
		}
		switch inst := m.Field(i).Interface().(type) {
		case metric.Int64Counter:
			inst.Add(ctx, 1)
		case metric.Int64UpDownCounter:
			inst.Add(ctx, 1)
		case metric.Float64Histogram:
			inst.Record(ctx, 0.01)
		case metric.Int64Histogram:
			inst.Record(ctx, 1)
		case metric.Float64Counter:
			inst.Add(ctx, 1)
		default:
			t.Fatalf("telemetry.Metrics.%s is a %T: teach this test to record into it", f.Name, inst)
		}
	}
	// The lease metrics as the coordinator's observer records them, with
	// their labels.
	lo := tel.LeaseObserver()
	lease := leasehold.Lease{Scope: "orders", Partition: 0, Epoch: 5, Holder: "w1"}
	lo.LeaseEvent(ctx, coordinator.Event{Kind: coordinator.EventAcquired, Lease: lease, Time: time.Now()})
	lo.LeaseEvent(ctx, coordinator.Event{Kind: coordinator.EventRenewed, Lease: lease, Latency: time.Millisecond, Time: time.Now()})
	lo.LeaseEvent(ctx, coordinator.Event{Kind: coordinator.EventLost, Lease: lease, Reason: coordinator.LostDeadline, Time: time.Now()})
	tel.Metrics.SetEpoch("w1", 0, 5)
	tel.Metrics.SetLag("w1", 0, 3)
	tel.Metrics.SetStalled("w1", 0, true)
	tel.Metrics.SetSinkGap("s1", true)

	// A stale write refused for real.
	mem := sink.NewMemory(sink.MemoryConfig{Telemetry: tel.Config(), Logger: quietLogger()})
	stamp := func(e leasehold.Epoch, acq string) leasehold.Stamp {
		return leasehold.Stamp{Scope: "orders", Partition: 0, Epoch: e, Acquisition: acq, Key: "k" + acq, Worker: "w" + acq}
	}
	if err := mem.Apply(ctx, sink.Effect{Stamp: stamp(2, "b"), Subject: "x"}); err != nil {
		t.Fatal(err)
	}
	if err := mem.Apply(ctx, sink.Effect{Stamp: stamp(1, "a"), Subject: "y"}); err == nil {
		t.Fatal("the memory sink applied a stale write")
	}

	// An event the status page misses: there is no events stream.
	js := natstest.Start(t).JetStream(t)
	p := statuspage.NewPublisher(statuspage.PublisherConfig{JetStream: js, Prefix: "nowhere", MeterProvider: mp, Timeout: 5 * time.Second})
	p.Publish(statuspage.Event{Kind: statuspage.KindLost, Scope: "nowhere"})
	p.Close()
	if p.Dropped() != 1 {
		t.Fatalf("%d events dropped, want 1", p.Dropped())
	}

	rec := httptest.NewRecorder()
	handler.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	body = append(append(body, '\n'), setupSeries(t)...)
	series := map[string]map[string]bool{}
	sample := regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? `)
	label := regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="`)
	for _, line := range bytes.Split(body, []byte("\n")) {
		mm := sample.FindSubmatch(line)
		if mm == nil || !bytes.HasPrefix(mm[1], []byte("leasehold_")) {
			continue
		}
		name := string(mm[1])
		if series[name] == nil {
			series[name] = map[string]bool{}
		}
		for _, l := range label.FindAllSubmatch(mm[2], -1) {
			series[name][string(l[1])] = true
		}
	}
	if len(series) == 0 {
		t.Fatalf("no leasehold_* series on /metrics:\n%s", body)
	}
	return series
}

// setupSeries is the /metrics body of a process built with
// telemetry.Setup whose collector refuses every export: the span drop
// counter is Setup's own.
func setupSeries(t *testing.T) []byte {
	t.Helper()
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		http.Error(w, "refused", http.StatusBadRequest)
	}))
	defer collector.Close()
	ctx := context.Background()
	tel, handler, shutdown, err := telemetry.Setup(ctx, telemetry.SetupConfig{OTLPEndpoint: collector.URL, NoGlobals: true, Sampler: sdktrace.AlwaysSample()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = shutdown(ctx) }()
	_, span := tel.Tracer.Start(ctx, "dropped")
	span.End()
	if f, ok := tel.Config().TracerProvider.(interface{ ForceFlush(context.Context) error }); ok {
		_ = f.ForceFlush(ctx) // refused: counted as dropped
	}
	rec := httptest.NewRecorder()
	handler.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	if !bytes.Contains(body, []byte("leasehold_trace_spans_dropped_total{")) {
		t.Fatalf("no leasehold_trace_spans_dropped_total after a refused export:\n%s", body)
	}
	return body
}

// grafanaDashboard is the part of a Grafana dashboard the test reads.
type grafanaDashboard struct {
	UID    string `json:"uid"`
	Title  string `json:"title"`
	Panels []struct {
		ID         int    `json:"id"`
		Title      string `json:"title"`
		Type       string `json:"type"`
		Datasource struct {
			Type string `json:"type"`
			UID  string `json:"uid"`
		} `json:"datasource"`
		GridPos struct{ H, W, X, Y int } `json:"gridPos"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name string `json:"name"`
			Type string `json:"type"`
		} `json:"list"`
	} `json:"templating"`
}

// Labels that Prometheus adds when it scrapes, or that histograms carry.
var scrapeLabels = map[string]bool{"instance": true, "job": true, "le": true}

var (
	metricRef = regexp.MustCompile(`\bleasehold_[a-z0-9_]+`)
	// Where label names stand: inside braces and by/without lists.
	labelPlaces = regexp.MustCompile(`\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)`)
	// metric{matchers} and by/without (labels)
	selector = regexp.MustCompile(`(leasehold_[a-z0-9_]+)\{([^}]*)\}`)
	matcher  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	grouping = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)\s*\(`)
)

// TestGrafanaDashboard checks deploy/grafana/leasehold.json against the
// metrics leasehold really exports: every leasehold_* name a query uses is
// exported, every label it matches or groups by is on that metric, each
// panel has a query on the dashboard's Prometheus variable, and the
// dashboard covers the fence (applied against refused writes, stale
// refusals per scope), leases (take-overs, losses), stalls, sink gaps,
// dead letters and lag.
func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	series := exportedSeries(t)
	var names []string
	for n := range series {
		names = append(names, n)
	}
	slices.Sort(names)
	t.Logf("exported: %s", strings.Join(names, " "))
	for _, p := range checkDashboard(series, readFile(t, "grafana/leasehold.json")) {
		t.Error(p)
	}
}

// The check fails on a dashboard that names a metric leasehold does not
// export, matches or groups by a label the metric lacks, or leaves out
// what an operator must see.
func TestGrafanaDashboardCheckCanFail(t *testing.T) {
	t.Parallel()
	series := exportedSeries(t)
	b := readFile(t, "grafana/leasehold.json")
	for _, c := range []struct{ old, new, want string }{
		{"(leasehold_sink_gap)", "(leasehold_sink_gaps)", "leasehold_sink_gaps is not exported"},
		{`leasehold_sink_effects_total{leasehold_outcome=\"dead_lettered\"}`, `leasehold_sink_effects_total{leasehold_scope=\"x\"}`, "has no label leasehold_scope"},
		{"sum by (leasehold_reason)", "sum by (leasehold_sink)", "groups by"},
		{"leasehold_consumer_lag)", "leasehold_leases_held)", "does not show lag"},
		{`"uid": "${datasource}"`, `"uid": "P1809F7CD0C75ACF3"`, "data source"},
	} {
		problems := checkDashboard(series, mutate(t, b, c.old, c.new))
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, c.want) }) {
			t.Errorf("%s -> %s: want a problem with %q, got %q", c.old, c.new, c.want, problems)
		}
	}
}

// checkDashboard returns what is wrong with a dashboard, given the series
// leasehold exports.
func checkDashboard(series map[string]map[string]bool, b []byte) []string {
	var problems []string
	fail := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	var d grafanaDashboard
	if err := json.Unmarshal(b, &d); err != nil {
		return []string{"grafana/leasehold.json: " + err.Error()}
	}
	if d.UID == "" || d.Title == "" || len(d.Panels) == 0 {
		fail("dashboard without uid, title or panels: %q %q %d", d.UID, d.Title, len(d.Panels))
	}
	dsVar := ""
	for _, v := range d.Templating.List {
		if v.Type == "datasource" {
			dsVar = "${" + v.Name + "}"
		}
	}
	if dsVar == "" {
		fail("the dashboard has no datasource variable: it would be bound to one Grafana's data source UID")
	}
	used := map[string]bool{}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			fail("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if p.Datasource.Type != "prometheus" || p.Datasource.UID != dsVar {
			fail("panel %q: data source %+v, want prometheus %s", p.Title, p.Datasource, dsVar)
		}
		if len(p.Targets) == 0 {
			fail("panel %q has no query", p.Title)
		}
		if p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			fail("panel %q: grid position %+v does not fit Grafana's 24 columns", p.Title, p.GridPos)
		}
		for _, q := range p.Targets {
			refs := metricRef.FindAllString(labelPlaces.ReplaceAllString(q.Expr, " "), -1)
			if len(refs) == 0 {
				fail("panel %q: query %q reads no leasehold_* metric", p.Title, q.Expr)
			}
			for _, n := range refs {
				used[n] = true
				if series[n] == nil {
					fail("panel %q: %s is not exported (query %q)", p.Title, n, q.Expr)
				}
			}
			for _, s := range selector.FindAllStringSubmatch(q.Expr, -1) {
				for _, l := range matcher.FindAllStringSubmatch(s[2], -1) {
					if series[s[1]] != nil && !series[s[1]][l[1]] && !scrapeLabels[l[1]] {
						fail("panel %q: %s has no label %s (query %q)", p.Title, s[1], l[1], q.Expr)
					}
				}
			}
			for _, g := range grouping.FindAllStringSubmatch(q.Expr, -1) {
				for _, l := range strings.Split(g[1], ",") {
					l = strings.TrimSpace(l)
					if l == "" || scrapeLabels[l] {
						continue
					}
					found := false
					for _, n := range refs {
						found = found || series[n][l]
					}
					if !found {
						fail("panel %q: no metric of the query has the label %s it groups by (query %q)", p.Title, l, q.Expr)
					}
				}
			}
		}
	}
	// What an operator must see, each through the metric that tells it.
	for _, want := range []struct{ what, metric string }{
		{"applied against refused writes", "leasehold_sink_effects_total"},
		{"stale refusals per scope", "leasehold_sink_refusals_total"},
		{"take-overs", "leasehold_lease_acquisitions_total"},
		{"lease losses", "leasehold_lease_losses_total"},
		{"stalled partitions", "leasehold_partition_stalled"},
		{"sinks stopped at a gap", "leasehold_sink_gap"},
		{"dead letters", "leasehold_jobs_dead_lettered_total"},
		{"lag", "leasehold_consumer_lag"},
	} {
		if !used[want.metric] {
			fail("the dashboard does not show %s (%s)", want.what, want.metric)
		}
	}
	return problems
}
