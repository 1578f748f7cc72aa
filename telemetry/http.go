package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/exemplar"
	"go.opentelemetry.io/otel/sdk/resource"
)

// NewPrometheus returns a MeterProvider whose metrics are served, in the
// Prometheus text format, by the returned handler. It uses its own
// registry (plus the Go runtime and process collectors), not the global
// one. Exemplars are off (the text format cannot carry them) unless
// OTEL_METRICS_EXEMPLAR_FILTER says otherwise.
func NewPrometheus() (*sdkmetric.MeterProvider, http.Handler, error) {
	return newPrometheus(nil)
}

func newPrometheus(res *resource.Resource) (*sdkmetric.MeterProvider, http.Handler, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	exp, err := otelprom.New(otelprom.WithRegisterer(reg), otelprom.WithoutScopeInfo())
	if err != nil {
		return nil, nil, fmt.Errorf("telemetry: prometheus exporter: %w", err)
	}
	opts := []sdkmetric.Option{sdkmetric.WithReader(exp)}
	if os.Getenv("OTEL_METRICS_EXEMPLAR_FILTER") == "" {
		// The Prometheus text format carries no exemplars, and collecting
		// them costs each measurement made under a sampled span.
		opts = append(opts, sdkmetric.WithExemplarFilter(exemplar.AlwaysOffFilter))
	}
	if res != nil {
		opts = append(opts, sdkmetric.WithResource(res))
	}
	mp := sdkmetric.NewMeterProvider(opts...)
	return mp, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), nil
}

// ReadyFunc reports whether the process can do its work.
type ReadyFunc func(ctx context.Context) error

// NATSReady is ready when nc is connected and the JetStream API answers.
func NATSReady(nc *nats.Conn, js jetstream.JetStream) ReadyFunc {
	return func(ctx context.Context) error {
		if !nc.IsConnected() {
			return fmt.Errorf("NATS is not connected (status %s)", nc.Status())
		}
		if _, err := js.AccountInfo(ctx); err != nil {
			// A server that just went away can leave the connection
			// looking connected until the client notices.
			return fmt.Errorf("NATS JetStream does not answer: %w", err)
		}
		return nil
	}
}

// Pinger is a database handle that can check its connection:
// *pgxpool.Pool and *pgx.Conn fit; for a *sql.DB, pass a type whose
// Ping calls PingContext.
type Pinger interface {
	Ping(ctx context.Context) error
}

// PingReady is ready when db answers a ping, for processes that write to
// a database (a pgsink, for one).
func PingReady(name string, db Pinger) ReadyFunc {
	return func(ctx context.Context) error {
		if err := db.Ping(ctx); err != nil {
			return fmt.Errorf("%s does not answer: %w", name, err)
		}
		return nil
	}
}

// Mux serves /metrics (when metrics is not nil), /livez (always 200 while
// the process serves HTTP) and /readyz (200 when every check passes, 503
// with the failures otherwise).
func Mux(metrics http.Handler, checks ...ReadyFunc) *http.ServeMux {
	mux := http.NewServeMux()
	if metrics != nil {
		mux.Handle("GET /metrics", metrics)
	}
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		var errs []error
		for _, check := range checks {
			if err := check(ctx); err != nil {
				errs = append(errs, err)
			}
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if err := errors.Join(errs...); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, "not ready:", err)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}
