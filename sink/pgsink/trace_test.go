package pgsink_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// A refused write, through Apply or ApplyTx, is an error span under the
// writer's, naming the holder the fence was advanced for.
func TestRefusalSpan(t *testing.T) {
	t.Parallel()
	srv := pgtest.Start(t)
	db := pool(t, srv.CreateDatabase(t, "traced"))
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	s := newSink(t, db, pgsink.Config{Telemetry: telemetry.Config{TracerProvider: tp}})
	taker := lease("jobs", 2, 9)
	taker.Holder = "b"
	if err := s.Advance(ctxFor(t, time.Minute), taker); err != nil {
		t.Fatal(err)
	}
	ctx, handler := tp.Tracer("test").Start(ctxFor(t, time.Minute), "process jobs")
	former := lease("jobs", 2, 7)
	former.Holder = "a"
	stamp := former.Stamp("k")
	errApply := s.Apply(ctx, sink.Effect{Stamp: stamp, Subject: "x"})
	stamp.Key = "k2"
	errTx := s.ApplyTx(ctx, stamp, func(context.Context, pgx.Tx) error { return nil })
	handler.End()
	for _, err := range []error{errApply, errTx} {
		var se *leasehold.StaleEpochError
		if !errors.As(err, &se) || se.Holder != "b" || se.Max != 9 {
			t.Fatalf("refusal %v, want epoch 7 under 9 held by b", err)
		}
	}
	var n int
	for _, sp := range rec.Ended() {
		if sp.Name() != "apply" {
			continue
		}
		n++
		attrs := map[string]any{}
		for _, a := range sp.Attributes() {
			attrs[string(a.Key)] = a.Value.AsInterface()
		}
		if sp.Parent().SpanID() != handler.SpanContext().SpanID() || sp.Status().Code != codes.Error ||
			attrs["error.type"] != "stale_epoch" || attrs["leasehold.holder"] != "b" || attrs["leasehold.worker"] != "a" ||
			attrs["leasehold.max_epoch"] != int64(9) || attrs["leasehold.sink"] != "postgres" {
			t.Errorf("apply span: parent %v, status %v, attributes %v", sp.Parent().SpanID(), sp.Status(), attrs)
		}
	}
	if n != 2 {
		t.Fatalf("%d apply spans, want 2", n)
	}
}

// A sink process is ready while PostgreSQL answers, and says so when it
// stops answering.
func TestPingReady(t *testing.T) {
	t.Parallel()
	srv := pgtest.Start(t)
	db := pool(t, srv.CreateDatabase(t, "ready"))
	web := httptest.NewServer(telemetry.Mux(nil, telemetry.PingReady("PostgreSQL", db)))
	defer web.Close()
	get := func() (int, string) {
		resp, err := http.Get(web.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get(); code != http.StatusOK {
		t.Fatalf("readyz with PostgreSQL up: %d %s", code, body)
	}
	srv.Stop()
	if code, body := get(); code != http.StatusServiceUnavailable || !strings.Contains(body, "PostgreSQL does not answer") {
		t.Fatalf("readyz with PostgreSQL down: %d %s", code, body)
	}
}
