package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

func TestLeaseObserverSpansAndMetrics(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	mp, metrics, err := telemetry.NewPrometheus()
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Shutdown(context.Background())
	tel := telemetry.New(telemetry.Config{TracerProvider: tp, MeterProvider: mp})

	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// Lease 1 must live until it is released, while the test waits for
	// lease 2 to expire: it gets a 10s TTL, which no stall of a busy
	// machine outlasts. Only lease 2, the one meant to be lost, has the
	// short TTL, so the wait is still a second. The TTL is a coordinator's,
	// hence two coordinators on one observer.
	c, err := coordinator.New(b, coordinator.Config{Worker: "w1", TTL: 10 * time.Second, Observer: tel.LeaseObserver()})
	if err != nil {
		t.Fatal(err)
	}
	short, err := coordinator.New(b, coordinator.Config{Worker: "w2", TTL: time.Second, Observer: tel.LeaseObserver()})
	if err != nil {
		t.Fatal(err)
	}
	l1, err := c.Acquire(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	l2, err := short.Acquire(ctx, 2, coordinator.ManualRenew())
	if err != nil {
		t.Fatal(err)
	}
	// Lease 1 renews itself only every 3.3s, after the test is over:
	// renew it once by hand for the renewal metric.
	if err := l1.Renew(ctx); err != nil {
		t.Fatal(err)
	}
	<-l2.Done() // lost at its local deadline
	if err := l1.Release(ctx); err != nil {
		t.Fatal(err)
	}

	names := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		names[s.Name()] = s
	}
	for _, want := range []string{"lease acquire", "lease lost", "lease release"} {
		if names[want] == nil {
			t.Fatalf("no %q span among %v", want, names)
		}
	}
	lost := names["lease lost"]
	if lost.Status().Code != codes.Error {
		t.Errorf("lease lost status %v", lost.Status())
	}
	if v, _ := attr(lost.Attributes(), telemetry.AttrPartition); v.AsInt64() != 2 {
		t.Errorf("lease lost partition %v", v)
	}
	if v, _ := attr(lost.Attributes(), telemetry.AttrEpoch); v.AsInt64() != int64(l2.Epoch()) {
		t.Errorf("lease lost epoch %v, want %d", v, l2.Epoch())
	}
	if v, _ := attr(lost.Attributes(), telemetry.AttrReason); v.AsString() != "deadline" {
		t.Errorf("lease lost reason %v", v)
	}

	srv := httptest.NewServer(telemetry.Mux(metrics))
	defer srv.Close()
	body := scrape(t, srv.URL+"/metrics")
	for _, want := range []string{
		"leasehold_lease_acquisitions_total 2",
		`leasehold_lease_losses_total{leasehold_reason="deadline"} 1`,
		"leasehold_leases_held 0",
		"leasehold_lease_renew_duration_seconds_bucket",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q:\n%s", want, grep(body, "leasehold_"))
		}
	}
}

func TestReadiness(t *testing.T) {
	s := natstest.Start(t, natstest.Listen())
	nc := s.Connect(t)
	js, _ := jetstream.New(nc)
	srv := httptest.NewServer(telemetry.Mux(nil, telemetry.NATSReady(nc, js)))
	defer srv.Close()
	if body := scrape(t, srv.URL+"/readyz"); !strings.Contains(body, "ok") {
		t.Fatalf("readyz: %s", body)
	}
	s.Shutdown()
	resp, err := http.Get(srv.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), "NATS") {
		t.Fatalf("readyz with NATS down: %d %s", resp.StatusCode, b)
	}
	if body := scrape(t, srv.URL+"/livez"); !strings.Contains(body, "ok") {
		t.Fatalf("livez: %s", body)
	}
}
