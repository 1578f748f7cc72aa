package telemetry_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"

	"github.com/leasehold/leasehold/telemetry"
)

// Helpers the tests of this package share: a quiet logger, and serving,
// scraping and reading the Prometheus exposition.

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	return string(b)
}

func attr(attrs []attribute.KeyValue, k attribute.Key) (attribute.Value, bool) {
	for _, a := range attrs {
		if a.Key == k {
			return a.Value, true
		}
	}
	return attribute.Value{}, false
}

func grep(body, prefix string) string {
	var out []string
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, prefix) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

// serve serves h until the test ends and returns its URL.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(telemetry.Mux(h))
	t.Cleanup(srv.Close)
	return srv.URL
}

// value reads the value of the series that starts a line with prefix.
func value(body, prefix string) (float64, bool) {
	for _, line := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			v, err := strconv.ParseFloat(rest, 64)
			return v, err == nil
		}
	}
	return 0, false
}

func missingLines(body string, want []string) []string {
	var out []string
	for _, w := range want {
		if !strings.Contains(body, w) {
			out = append(out, w)
		}
	}
	return out
}
