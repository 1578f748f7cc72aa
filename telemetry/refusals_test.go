package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
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
	tel, _, shutdown, err := telemetry.Setup(context.Background(), telemetry.SetupConfig{
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
	if err := shutdown(ctxFor(t, time.Minute)); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if plain >= ordinary {
		t.Fatalf("all %d ordinary spans were exported: the queue never overflowed, and the test shows nothing", plain)
	}
	if refused != refusals {
		t.Fatalf("%d of %d refusal spans exported (%d of %d ordinary ones): refusals were dropped with the rest", refused, refusals, plain, ordinary)
	}
	t.Logf("exported %d of %d ordinary spans and all %d refusals", plain, ordinary, refusals)
}
