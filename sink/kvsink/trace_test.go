package kvsink_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A refused write is an error span under the writer's, naming the holder
// the fence was advanced for, which the fence key keeps.
func TestRefusalSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	js := natstest.Start(t).JetStream(t)
	cfg := kvsink.Config{Bucket: "traced", Logger: quiet(), Telemetry: telemetry.Config{TracerProvider: tp}}
	s, err := kvsink.New(ctxFor(t, time.Minute), js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Advance(ctxFor(t, time.Minute), leasehold.Lease{Scope: "orders", Partition: 2, Epoch: 9, Acquisition: "a9", Holder: "b"}); err != nil {
		t.Fatal(err)
	}
	// Another instance, as another process would have, reads the holder
	// from the fence key.
	other, err := kvsink.New(ctxFor(t, time.Minute), js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, handler := tp.Tracer("test").Start(ctxFor(t, time.Minute), "process jobs")
	err = other.Apply(ctx, sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 2, Epoch: 7, Acquisition: "a7", Key: "k", Worker: "a"}, Subject: "x"})
	handler.End()
	var se *leasehold.StaleEpochError
	if !errors.As(err, &se) || se.Holder != "b" || se.Max != 9 {
		t.Fatalf("refusal %v, want epoch 7 under 9 held by b", err)
	}
	var found bool
	for _, sp := range rec.Ended() {
		if sp.Name() != "apply" {
			continue
		}
		found = true
		attrs := map[string]any{}
		for _, a := range sp.Attributes() {
			attrs[string(a.Key)] = a.Value.AsInterface()
		}
		if sp.Parent().SpanID() != handler.SpanContext().SpanID() || sp.Status().Code != codes.Error ||
			attrs["error.type"] != "stale_epoch" || attrs["leasehold.holder"] != "b" || attrs["leasehold.worker"] != "a" ||
			attrs["leasehold.max_epoch"] != int64(9) || attrs["leasehold.sink"] != "kv" {
			t.Errorf("apply span: parent %v, status %v, attributes %v", sp.Parent().SpanID(), sp.Status(), attrs)
		}
	}
	if !found {
		t.Fatal("no apply span")
	}
}
