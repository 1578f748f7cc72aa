package telemetry_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/telemetry"
)

// The zombie's three refused writes are spans with status Error,
// error.type=stale_epoch, the refused stamp, the partition's maximum and
// holder, and the event leasehold.fence.rejected; the direct sinks' are
// children of A's process span, the stream runner's a child of A's send
// span, and all of them sit in the trace of the job's enqueue, with B's
// handling of the same job.
func TestRejectedWriteSpans(t *testing.T) {
	t.Parallel()
	forEachProvider(t, sdktrace.ParentBased(sdktrace.AlwaysSample()), testRejectedWriteSpans)
}

// forEachProvider runs test with an SDK tracer provider sampling with s
// into a recorder, and with the same provider as Setup hands it out when
// its sampler follows the parent (as s does).
func forEachProvider(t *testing.T, s sdktrace.Sampler, test func(*testing.T, *tracetest.SpanRecorder, trace.TracerProvider)) {
	if !telemetry.FollowsParent(s) {
		t.Fatalf("%s does not follow the parent", s.Description())
	}
	for _, wrap := range []bool{false, true} {
		name := "sdk"
		if wrap {
			name = "setup"
		}
		t.Run(name, func(t *testing.T) {
			rec := tracetest.NewSpanRecorder()
			sdk := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(s))
			defer sdk.Shutdown(context.Background())
			var tp trace.TracerProvider = sdk
			if wrap {
				tp = telemetry.ParentDecides(sdk)
			}
			test(t, rec, tp)
		})
	}
}

func testRejectedWriteSpans(t *testing.T, rec *tracetest.SpanRecorder, tp trace.TracerProvider) {
	mp, metrics, err := telemetry.NewPrometheus()
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Shutdown(context.Background())
	run := runZombie(t, telemetry.Config{TracerProvider: tp, MeterProvider: mp, Propagator: propagation.TraceContext{}})

	spans := spanIndex(rec.Ended())
	defer func() {
		if t.Failed() || testing.Verbose() {
			t.Logf("the job's trace:\n%s", tree(spans, run.traceID))
		}
	}()
	enqueue := spans.one(t, "the enqueue", func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "send zz.jobs.{partition}"
	})
	if enqueue.SpanKind() != trace.SpanKindProducer || enqueue.SpanContext().TraceID() != run.traceID {
		t.Fatalf("enqueue span: kind %v, trace %v; want a producer span in trace %v", enqueue.SpanKind(), enqueue.SpanContext().TraceID(), run.traceID)
	}
	processA := spans.one(t, "A's process span", func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "process zz.jobs.{partition}" && str(s, telemetry.AttrWorker) == zombieA
	})
	processB := spans.one(t, "B's process span", func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "process zz.jobs.{partition}" && str(s, telemetry.AttrWorker) == zombieB
	})
	for _, p := range []sdktrace.ReadOnlySpan{processA, processB} {
		if p.SpanKind() != trace.SpanKindConsumer || p.Parent().SpanID() != enqueue.SpanContext().SpanID() {
			t.Errorf("%s of %s: kind %v, parent %v; want a consumer child of the enqueue %v",
				p.Name(), str(p, telemetry.AttrWorker), p.SpanKind(), p.Parent().SpanID(), enqueue.SpanContext().SpanID())
		}
		if got := str(p, semconv.MessagingSystemKey); got != "nats" {
			t.Errorf("messaging.system %q", got)
		}
		if got := str(p, semconv.MessagingDestinationTemplateKey); got != "zz.jobs.{partition}" {
			t.Errorf("messaging.destination.template %q", got)
		}
	}
	if n(processA, telemetry.AttrEpoch) != int64(run.epochA) || n(processB, telemetry.AttrEpoch) != int64(run.epochB) {
		t.Errorf("process spans carry epochs %d and %d, want %d and %d", n(processA, telemetry.AttrEpoch), n(processB, telemetry.AttrEpoch), run.epochA, run.epochB)
	}
	// A's handler returned the refusals: its span says so too.
	if processA.Status().Code != codes.Error || str(processA, semconv.ErrorTypeKey) != telemetry.ErrorTypeStaleEpoch {
		t.Errorf("A's process span: status %v, error.type %q", processA.Status(), str(processA, semconv.ErrorTypeKey))
	}
	// A's handler emits two effects: the first is sent, and the stream
	// sink's process span is its child; the second is held back as the
	// attempt's last, and the failed attempt's abort marker is sent.
	sendA := spans.one(t, "A's send span the stream sink processed", func(s sdktrace.ReadOnlySpan) bool {
		if s.Name() != "send zz.out.{partition}" || str(s, telemetry.AttrWorker) != zombieA || boolean(s, telemetry.AttrBarrier) {
			return false
		}
		for _, c := range spans {
			if c.Name() == "process zz.out.{partition}" && c.Parent().SpanID() == s.SpanContext().SpanID() {
				return true
			}
		}
		return false
	})
	if sendA.SpanKind() != trace.SpanKindProducer || sendA.Parent().SpanID() != processA.SpanContext().SpanID() {
		t.Errorf("A's send span: kind %v, parent %v; want a producer child of A's process span", sendA.SpanKind(), sendA.Parent().SpanID())
	}

	for _, want := range []struct {
		sink, name string
		parent     sdktrace.ReadOnlySpan
	}{
		{"memory", "apply", processA},
		{"kv", "apply", processA},
		{"stream", "process zz.out.{partition}", sendA},
	} {
		s := spans.one(t, "the "+want.sink+" sink's refusal", func(s sdktrace.ReadOnlySpan) bool {
			return str(s, telemetry.AttrSink) == want.sink && str(s, semconv.ErrorTypeKey) == telemetry.ErrorTypeStaleEpoch
		})
		checkRejected(t, s, run)
		if s.Name() != want.name || s.Parent().SpanID() != want.parent.SpanContext().SpanID() {
			t.Errorf("%s refusal: %q, child of %v; want %q, child of %s (%v)", want.sink, s.Name(), s.Parent().SpanID(), want.name, want.parent.Name(), want.parent.SpanContext().SpanID())
		}
		if want.sink == "stream" && s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("the stream runner's span is %v, want consumer", s.SpanKind())
		}
	}
	for _, s := range rec.Ended() {
		if str(s, semconv.ErrorTypeKey) == telemetry.ErrorTypeStaleEpoch && s.SpanContext().TraceID() != run.traceID {
			t.Errorf("refusal %q (%s) is in trace %v, not the job's %v", s.Name(), str(s, telemetry.AttrSink), s.SpanContext().TraceID(), run.traceID)
		}
	}

	// B fenced the partition before its first job: a root span with a
	// child per fence and one for the barrier, which the stream runner
	// took in under it.
	fence := spans.one(t, "B's partition fence", func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "partition fence" && str(s, telemetry.AttrWorker) == zombieB
	})
	if fence.Parent().IsValid() || n(fence, telemetry.AttrEpoch) != int64(run.epochB) {
		t.Errorf("B's partition fence: parent %v, epoch %d", fence.Parent(), n(fence, telemetry.AttrEpoch))
	}
	var advances int
	var barrier sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.Parent().SpanID() != fence.SpanContext().SpanID() {
			continue
		}
		switch {
		case s.Name() == "fence advance":
			advances++
		case s.Name() == "send zz.out.{partition}" && boolean(s, telemetry.AttrBarrier):
			barrier = s
		}
	}
	if advances != 2 || barrier == nil {
		t.Fatalf("B's partition fence has %d fence advances and barrier %v; want 2 and one", advances, barrier)
	}
	spans.one(t, "the runner's span for B's barrier", func(s sdktrace.ReadOnlySpan) bool {
		return s.Parent().SpanID() == barrier.SpanContext().SpanID() && str(s, telemetry.AttrOutcome) == telemetry.OutcomeAdvanced
	})

	// Counted, too.
	body := scrape(t, serve(t, metrics)+"/metrics")
	for _, sinkName := range []string{"memory", "kv", "stream"} {
		want := fmt.Sprintf(`leasehold_sink_effects_total{leasehold_outcome="rejected_stale",leasehold_sink=%q} 1`, sinkName)
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s:\n%s", want, grep(body, "leasehold_sink"))
		}
	}
}

// checkRejected asserts what every refused zombie write carries.
func checkRejected(t *testing.T, s sdktrace.ReadOnlySpan, run zombieRun) {
	t.Helper()
	who := str(s, telemetry.AttrSink)
	if s.Status().Code != codes.Error || !strings.Contains(s.Status().Description, "stale") && !strings.Contains(s.Status().Description, "below") {
		t.Errorf("%s: status %+v", who, s.Status())
	}
	want := map[attribute.Key]any{
		telemetry.AttrPartition: int64(0),
		telemetry.AttrEpoch:     int64(run.epochA),
		telemetry.AttrMaxEpoch:  int64(run.epochB),
		telemetry.AttrWorker:    zombieA,
		telemetry.AttrHolder:    zombieB,
		semconv.ErrorTypeKey:    telemetry.ErrorTypeStaleEpoch,
	}
	for k, v := range want {
		if got, ok := attr(s.Attributes(), k); !ok || got.AsInterface() != v {
			t.Errorf("%s: %s = %v, want %v", who, k, got.AsInterface(), v)
		}
	}
	var ev *sdktrace.Event
	for i := range s.Events() {
		if s.Events()[i].Name == telemetry.EventFenceRejected {
			ev = &s.Events()[i]
		}
	}
	if ev == nil {
		t.Errorf("%s: no %s event among %v", who, telemetry.EventFenceRejected, s.Events())
		return
	}
	for k, v := range want {
		if k == semconv.ErrorTypeKey {
			continue
		}
		if got, ok := attr(ev.Attributes, k); !ok || got.AsInterface() != v {
			t.Errorf("%s: event %s = %v, want %v", who, k, got.AsInterface(), v)
		}
	}
}

type spanIndex []sdktrace.ReadOnlySpan

// one returns the single span that matches, failing the test otherwise.
func (ss spanIndex) one(t *testing.T, what string, match func(sdktrace.ReadOnlySpan) bool) sdktrace.ReadOnlySpan {
	t.Helper()
	var found []sdktrace.ReadOnlySpan
	for _, s := range ss {
		if match(s) {
			found = append(found, s)
		}
	}
	if len(found) != 1 {
		var names []string
		for _, s := range ss {
			names = append(names, fmt.Sprintf("%s[%s %s]", s.Name(), str(s, telemetry.AttrWorker), str(s, telemetry.AttrSink)))
		}
		t.Fatalf("%d spans match %s, want 1; spans: %s", len(found), what, strings.Join(names, ", "))
	}
	return found[0]
}

func str(s sdktrace.ReadOnlySpan, k attribute.Key) string {
	v, _ := attr(s.Attributes(), k)
	return v.AsString()
}

func n(s sdktrace.ReadOnlySpan, k attribute.Key) int64 {
	v, _ := attr(s.Attributes(), k)
	return v.AsInt64()
}

func boolean(s sdktrace.ReadOnlySpan, k attribute.Key) bool {
	v, _ := attr(s.Attributes(), k)
	return v.AsBool()
}

// tree draws the spans of one trace, children under parents, for failure
// messages.
func tree(ss []sdktrace.ReadOnlySpan, id trace.TraceID) string {
	kids := map[trace.SpanID][]sdktrace.ReadOnlySpan{}
	known := map[trace.SpanID]bool{}
	for _, s := range ss {
		if s.SpanContext().TraceID() == id {
			known[s.SpanContext().SpanID()] = true
		}
	}
	for _, s := range ss {
		if s.SpanContext().TraceID() != id {
			continue
		}
		parent := s.Parent().SpanID()
		if !known[parent] {
			parent = trace.SpanID{}
		}
		kids[parent] = append(kids[parent], s)
	}
	var b strings.Builder
	var draw func(trace.SpanID, string)
	draw = func(id trace.SpanID, indent string) {
		for _, s := range kids[id] {
			fmt.Fprintf(&b, "%s%s [%v] worker=%s sink=%s epoch=%d error.type=%s\n", indent, s.Name(), s.SpanKind(),
				str(s, telemetry.AttrWorker), str(s, telemetry.AttrSink), n(s, telemetry.AttrEpoch), str(s, semconv.ErrorTypeKey))
			draw(s.SpanContext().SpanID(), indent+"  ")
		}
	}
	draw(trace.SpanID{}, "")
	return b.String()
}

// When the zombie's trace was not sampled, nothing of it is recorded but
// the three refusals, each the root of a trace of its own with the
// attributes and event of any refusal, linked to the zombie's trace (the
// stream runner's to the span that sent the effect, or, since an attempt
// that is not sampled starts no effect spans, to the attempt's).
func TestRejectedWriteSpansUnsampled(t *testing.T) {
	t.Parallel()
	forEachProvider(t, telemetry.KeepRefusals(sdktrace.ParentBased(sdktrace.NeverSample())), testRejectedWriteSpansUnsampled)
}

func testRejectedWriteSpansUnsampled(t *testing.T, rec *tracetest.SpanRecorder, tp trace.TracerProvider) {
	run := runZombie(t, telemetry.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}})

	sinks := map[string]bool{}
	for _, s := range rec.Ended() {
		who := str(s, telemetry.AttrSink)
		if str(s, semconv.ErrorTypeKey) != telemetry.ErrorTypeStaleEpoch || who == "" {
			t.Errorf("span %q (sink %q, error.type %q) recorded from a trace that was not sampled", s.Name(), who, str(s, semconv.ErrorTypeKey))
			continue
		}
		sinks[who] = true
		checkRejected(t, s, run)
		if s.Parent().IsValid() || len(s.Links()) != 1 || s.Links()[0].SpanContext.TraceID() != run.traceID {
			t.Errorf("%s refusal: parent %v, links %v; want a root linked to trace %v", who, s.Parent().SpanID(), s.Links(), run.traceID)
		}
	}
	if !sinks["memory"] || !sinks["kv"] || !sinks["stream"] {
		t.Fatalf("refusals recorded from %v, want memory, kv and stream", sinks)
	}
}
