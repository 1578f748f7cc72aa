package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/telemetry"
)

// While the collector does not keep up, the batcher's queue fills and the
// SDK drops spans: the spans of refused writes have a queue of their own,
// and every one of them is exported. The receiver holds every export
// until all spans have ended, so the ordinary queue surely overflows.
func TestRefusalSpansSurviveAFullExportQueue(t *testing.T) {
	const ordinary, refusals = 12000, 300
	gate := make(chan struct{})
	var (
		mu             sync.Mutex
		plain, refused int
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		<-gate
		var msg coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &msg); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		mu.Lock()
		for _, rs := range msg.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					if v, ok := kv(s.Attributes, "error.type"); ok && v.GetStringValue() == telemetry.ErrorTypeStaleEpoch {
						refused++
					} else {
						plain++
					}
				}
			}
		}
		mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	defer srv.Close()
	t.Setenv("OTEL_BSP_MAX_QUEUE_SIZE", "")
	tel, metrics, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{
		ServiceName: "refusals", OTLPEndpoint: srv.URL, NoGlobals: true, Sampler: sdktrace.AlwaysSample(),
	})
	if err != nil {
		t.Fatal(err)
	}
	tr := tel.Config().TracerProvider.Tracer("test")
	every := ordinary / refusals
	for i := range ordinary {
		_, s := tr.Start(context.Background(), "process")
		s.End()
		if i%every == 0 {
			_, r := tr.Start(context.Background(), "refused", trace.WithAttributes(semconv.ErrorTypeKey.String(telemetry.ErrorTypeStaleEpoch)))
			r.SetStatus(codes.Error, "stale epoch")
			r.End()
		}
	}
	close(gate)
	flush(t, tel)
	// Every span the batcher did not take is counted, and nothing else.
	mu.Lock()
	defer mu.Unlock()
	if got := droppedSpans(t, metrics, "spans", "queue_full"); got != ordinary-plain {
		t.Errorf("leasehold_trace_spans_dropped_total{queue_full} = %d, but %d of %d ordinary spans were not exported", got, ordinary-plain, ordinary)
	}
	for _, c := range [][2]string{{"refusals", "queue_full"}, {"spans", "export_failed"}, {"refusals", "export_failed"}} {
		if got := droppedSpans(t, metrics, c[0], c[1]); got != 0 {
			t.Errorf("leasehold_trace_spans_dropped_total{leasehold_queue=%q, leasehold_reason=%q} = %d, want 0", c[0], c[1], got)
		}
	}
	if err := shutdown(ctxFor(t, time.Minute)); err != nil {
		t.Fatal(err)
	}
	if plain >= ordinary {
		t.Fatalf("all %d ordinary spans were exported: the queue never overflowed, and the test shows nothing", plain)
	}
	if refused != refusals {
		t.Fatalf("%d of %d refusal spans exported (%d of %d ordinary ones): refusals were dropped with the rest", refused, refusals, plain, ordinary)
	}
	t.Logf("exported %d of %d ordinary spans and all %d refusals", plain, ordinary, refusals)
}

// Spans an export loses for good (the receiver refuses them) are counted
// as dropped too.
func TestRefusedExportsCountAsDroppedSpans(t *testing.T) {
	const spans = 50
	var posts atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		posts.Add(1)
		http.Error(w, "no", http.StatusBadRequest) // not retried
	}))
	defer srv.Close()
	tel, metrics, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{
		ServiceName: "refused-exports", OTLPEndpoint: srv.URL, NoGlobals: true, Sampler: sdktrace.AlwaysSample(),
	})
	if err != nil {
		t.Fatal(err)
	}
	tr := tel.Config().TracerProvider.Tracer("test")
	for range spans {
		_, s := tr.Start(context.Background(), "process")
		s.End()
	}
	// One refused write: its own queue, counted apart.
	_, r := tr.Start(context.Background(), "refused", trace.WithAttributes(semconv.ErrorTypeKey.String(telemetry.ErrorTypeStaleEpoch)))
	r.SetStatus(codes.Error, "stale epoch")
	r.End()
	flush(t, tel)
	defer shutdown(ctxFor(t, time.Minute))
	if posts.Load() == 0 {
		t.Fatal("nothing was posted: the test shows nothing")
	}
	if got := droppedSpans(t, metrics, "spans", "export_failed"); got != spans {
		t.Errorf("leasehold_trace_spans_dropped_total{spans, export_failed} = %d, want %d", got, spans)
	}
	if got := droppedSpans(t, metrics, "refusals", "export_failed"); got != 1 {
		t.Errorf("leasehold_trace_spans_dropped_total{refusals, export_failed} = %d, want 1", got)
	}
}

// flush exports every span ended so far (an export that fails is
// counted, not an error here).
func flush(t *testing.T, tel *telemetry.Telemetry) {
	t.Helper()
	f, ok := tel.Config().TracerProvider.(interface{ ForceFlush(context.Context) error })
	if !ok {
		t.Fatalf("Setup's tracer provider %T has no ForceFlush", tel.Config().TracerProvider)
	}
	_ = f.ForceFlush(ctxFor(t, time.Minute))
}

// droppedSpans reads leasehold_trace_spans_dropped_total for one queue and
// reason from a Prometheus handler; 0 when it has no such series.
func droppedSpans(t *testing.T, metrics http.Handler, queue, reason string) int {
	t.Helper()
	rec := httptest.NewRecorder()
	metrics.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if !strings.HasPrefix(line, "leasehold_trace_spans_dropped_total{") ||
			!strings.Contains(line, `leasehold_queue="`+queue+`"`) || !strings.Contains(line, `leasehold_reason="`+reason+`"`) {
			continue
		}
		n, err := strconv.Atoi(line[strings.LastIndexByte(line, ' ')+1:])
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		return n
	}
	return 0
}
