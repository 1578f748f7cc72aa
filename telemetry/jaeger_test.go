package telemetry_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/leasehold/leasehold/internal/freeport"
	"github.com/leasehold/leasehold/internal/testbuf"
	"github.com/leasehold/leasehold/telemetry"
)

// The opt-in end-to-end test with Jaeger v2. It is skipped unless
// LEASEHOLD_JAEGER_TEST=1, because building Jaeger takes about four
// minutes cold:
//
//	LEASEHOLD_JAEGER_TEST=1 go test -run TestJaeger -v ./telemetry/
//
// It builds Jaeger from the tools/jaeger module (or runs the binary
// LEASEHOLD_JAEGER_BIN names), starts it with tools/jaeger/config.yaml on
// free loopback ports, exports the zombie's trace to it over OTLP/HTTP, and
// finds the refused writes through Jaeger's HTTP query API the way a
// person would: by the tag error.type=stale_epoch, then by trace ID.
func TestJaeger(t *testing.T) {
	if os.Getenv("LEASEHOLD_JAEGER_TEST") != "1" {
		t.Skip("set LEASEHOLD_JAEGER_TEST=1 to run Jaeger (built from tools/jaeger, or LEASEHOLD_JAEGER_BIN)")
	}
	j := startJaeger(t)
	const service = "leasehold-jaeger-test"
	tel, _, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{
		ServiceName: service, OTLPEndpoint: "http://" + j.otlp, NoGlobals: true,
		Sampler: sdktrace.AlwaysSample(),
	})
	if err != nil {
		t.Fatal(err)
	}
	run := runZombie(t, tel.Config())
	if err := shutdown(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}

	// The search an on-call engineer runs: every trace of the service
	// with a refused write.
	q := url.Values{"service": {service}, "tags": {`{"error.type":"stale_epoch"}`}, "lookback": {"1h"}, "limit": {"20"}}
	var found []jaegerTrace
	deadline := time.Now().Add(time.Minute)
	for {
		found = j.traces(t, "/api/traces?"+q.Encode())
		if len(found) > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond) // Jaeger's batch processor stores every 200ms
	}
	if len(found) != 1 || found[0].TraceID != run.traceID.String() {
		t.Fatalf("search by error.type=stale_epoch found %d traces, want the zombie's %v:\n%s", len(found), run.traceID, j.logs())
	}
	checkJaegerTrace(t, found[0], run)

	// The same trace by its ID, as a link from a log line would open it.
	byID := j.traces(t, "/api/traces/"+run.traceID.String())
	if len(byID) != 1 {
		t.Fatalf("trace %v by ID: %d traces", run.traceID, len(byID))
	}
	checkJaegerTrace(t, byID[0], run)
}

func checkJaegerTrace(t *testing.T, tr jaegerTrace, run zombieRun) {
	t.Helper()
	byID := map[string]jaegerSpan{}
	for _, s := range tr.Spans {
		byID[s.SpanID] = s
	}
	parent := func(s jaegerSpan) jaegerSpan {
		for _, r := range s.References {
			if r.RefType == "CHILD_OF" {
				return byID[r.SpanID]
			}
		}
		return jaegerSpan{}
	}
	refused := map[string]jaegerSpan{}
	for _, s := range tr.Spans {
		if sinkName, ok := s.tag("leasehold.sink").(string); ok && s.tag("error.type") == telemetry.ErrorTypeStaleEpoch {
			refused[sinkName] = s
		}
	}
	for _, sinkName := range []string{"memory", "kv", "stream"} {
		s, ok := refused[sinkName]
		if !ok {
			t.Errorf("no refusal by the %s sink in the trace", sinkName)
			continue
		}
		for key, want := range map[string]any{
			"leasehold.worker": zombieA, "leasehold.holder": zombieB,
			"leasehold.epoch": float64(run.epochA), "leasehold.max_epoch": float64(run.epochB), "leasehold.partition": float64(0),
		} {
			if got := s.tag(key); got != want {
				t.Errorf("%s refusal: tag %s = %v (%T), want %v", sinkName, key, got, got, want)
			}
		}
		if s.tag("otel.status_code") != "ERROR" {
			t.Errorf("%s refusal: otel.status_code %v", sinkName, s.tag("otel.status_code"))
		}
		if !s.hasLog(telemetry.EventFenceRejected) {
			t.Errorf("%s refusal: no %s log among %+v", sinkName, telemetry.EventFenceRejected, s.Logs)
		}
		// The refusal leads back to A's handling of the job.
		p := parent(s)
		if sinkName == "stream" {
			if p.OperationName != "send zz.out.{partition}" || p.tag("leasehold.worker") != zombieA {
				t.Errorf("the stream refusal's parent is %q of %v, want A's send span", p.OperationName, p.tag("leasehold.worker"))
			}
			p = parent(p)
		}
		if p.OperationName != "process zz.jobs.{partition}" || p.tag("leasehold.worker") != zombieA {
			t.Errorf("the %s refusal leads to %q of %v, want A's process span", sinkName, p.OperationName, p.tag("leasehold.worker"))
		}
	}
}

type jaeger struct {
	otlp, query string // host:port
	out         *lockedBuffer
}

// startJaeger runs Jaeger until the test ends.
func startJaeger(t *testing.T) *jaeger {
	t.Helper()
	bin := os.Getenv("LEASEHOLD_JAEGER_BIN")
	if bin == "" {
		bin = filepath.Join(t.TempDir(), "jaeger")
		t.Log("building Jaeger from tools/jaeger (about four minutes cold; set LEASEHOLD_JAEGER_BIN to skip)")
		build := exec.Command("go", "build", "-o", bin, "github.com/jaegertracing/jaeger/cmd/jaeger")
		build.Dir = filepath.Join("..", "tools", "jaeger")
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build Jaeger: %v\n%s", err, out)
		}
	}
	base, err := os.ReadFile(filepath.Join("..", "tools", "jaeger", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	// The repository's configuration, on ports of this test's own.
	ports := map[string]string{}
	var pairs []string
	for _, p := range []string{"4317", "4318", "16686", "16685", "13133"} {
		ports[p] = freePort(t)
		pairs = append(pairs, "127.0.0.1:"+p, "127.0.0.1:"+ports[p])
	}
	cfg := strings.NewReplacer(pairs...).Replace(string(base))
	for _, line := range strings.Split(cfg, "\n") {
		if ep, ok := strings.CutPrefix(strings.TrimSpace(line), "endpoint:"); ok && !strings.Contains(ep, "127.0.0.1:") {
			t.Fatalf("tools/jaeger/config.yaml binds %s, which this test does not move to a free port", ep)
		}
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	j := &jaeger{otlp: "127.0.0.1:" + ports["4318"], query: "127.0.0.1:" + ports["16686"], out: &lockedBuffer{}}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, "--config", path)
	cmd.Stdout, cmd.Stderr = j.out, j.out
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
	})
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := http.Get("http://" + j.query + "/api/services")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return j
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("Jaeger's query API did not answer within two minutes:\n%s", j.logs())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (j *jaeger) logs() string { return j.out.String() }

// traces fetches a query API path that answers with traces.
func (j *jaeger) traces(t *testing.T, path string) []jaegerTrace {
	t.Helper()
	resp, err := http.Get("http://" + j.query + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Data   []jaegerTrace `json:"data"`
		Errors []any         `json:"errors"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNotFound {
		t.Fatalf("GET %s: %d %v", path, resp.StatusCode, body.Errors)
	}
	return body.Data
}

type jaegerTrace struct {
	TraceID string       `json:"traceID"`
	Spans   []jaegerSpan `json:"spans"`
}

type jaegerSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	Tags []jaegerKV `json:"tags"`
	Logs []struct {
		Fields []jaegerKV `json:"fields"`
	} `json:"logs"`
}

type jaegerKV struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

func (s jaegerSpan) tag(key string) any {
	for _, kv := range s.Tags {
		if kv.Key == key {
			return kv.Value
		}
	}
	return nil
}

func (s jaegerSpan) hasLog(event string) bool {
	for _, l := range s.Logs {
		for _, f := range l.Fields {
			if f.Key == "event" && f.Value == event {
				return true
			}
		}
	}
	return false
}

// freePort is a loopback port for Jaeger to listen on, below the kernel's
// ephemeral ports, so that no outgoing connection takes it before Jaeger
// starts.
func freePort(t *testing.T) string {
	t.Helper()
	port, err := freeport.Loopback()
	if err != nil {
		t.Fatal(err)
	}
	return strconv.Itoa(port)
}

// lockedBuffer collects a child process's output.
type lockedBuffer struct{ testbuf.Buffer }

func (b *lockedBuffer) String() string {
	return fmt.Sprintf("--- jaeger output ---\n%s", b.Buffer.String())
}
