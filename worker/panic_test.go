package worker_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// A handler's panic reads as one line wherever an operator meets it: the
// failure event's error, the log line and the dead letter's
// Leasehold-Error say "panic: <value> at <file:line>". Its stack is kept
// once, whole: in the attempt's span and in the dead letter's
// Leasehold-Stack. (The span also names the partition and the worker in
// OpenTelemetry's messaging attributes.)
func TestPanicIsOneLineAndItsStackKeptOnce(t *testing.T) {
	e := newEnv(t, 1)
	enq := e.enqueue(t, 0, 1)
	rec := newRecorder()
	spans := tracetest.NewSpanRecorder()
	logs := &syncBuffer{}
	cfg := e.config("w", worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		var orders map[string]int
		orders["o-1"]++ // a nil map: the runtime panics here
		return nil
	}))
	cfg.MaxAttempts = 2
	cfg.Observer = rec
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	cfg.Telemetry = telemetry.Config{TracerProvider: trace.NewTracerProvider(trace.WithSpanProcessor(spans))}
	start(t, cfg)
	// The runner logs the dead letter just after its event: wait for both.
	rec.waitFor(t, 30*time.Second, "the job dead-lettered, and its log line", func() bool {
		return rec.count(kind(worker.EventJobDeadLettered)) == 1 && strings.Contains(logs.String(), `msg="job dead-lettered"`)
	})

	const want = "panic: assignment to entry in nil map at worker/panic_test.go:"
	var pe *worker.PanicError
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventJobFailed || ev.Kind == worker.EventJobDeadLettered {
			if !errors.As(ev.Err, &pe) || !strings.HasPrefix(ev.Err.Error(), want) || strings.Contains(ev.Err.Error(), "\n") {
				t.Fatalf("%v event's error: %q, want one line starting %q", ev.Kind, ev.Err, want)
			}
		}
	}
	if pe == nil || !strings.Contains(string(pe.Stack), "goroutine ") || !strings.Contains(string(pe.Stack), "panic_test.go") {
		t.Fatalf("the panic error does not keep the stack: %+v", pe)
	}
	if line, err := strconv.Atoi(strings.TrimPrefix(pe.At, "worker/panic_test.go:")); err != nil || line == 0 {
		t.Errorf("panicked at %q, want the handler's line", pe.At)
	}

	for line := range strings.SplitSeq(logs.String(), "\n") {
		if strings.Contains(line, "goroutine ") || strings.Contains(line, "runtime/debug") {
			t.Errorf("a log line carries the stack: %.300s", line)
		}
	}
	if !strings.Contains(logs.String(), `msg="job dead-lettered"`) || !strings.Contains(logs.String(), `err="`+want) {
		t.Errorf("the log does not say where the handler panicked:\n%s", logs.String())
	}

	dlq := readStream(t, e.js, worker.DLQStream(e.prefix))
	if len(dlq) != 1 {
		t.Fatalf("%d dead letters", len(dlq))
	}
	h := dlq[0].Headers()
	if got := h.Get(worker.HeaderError); got != pe.Error() {
		t.Errorf("the dead letter's error is %q, want %q", got, pe.Error())
	}
	stack, err := strconv.Unquote(h.Get(worker.HeaderStack))
	if err != nil || stack != string(pe.Stack) {
		t.Errorf("the dead letter's stack (%v):\n%s\nwant:\n%s", err, stack, pe.Stack)
	}
	if dlq[0].Headers().Get(worker.HeaderSeq) != strconv.FormatUint(enq[0].Seq, 10) {
		t.Errorf("dead letter of seq %s", h.Get(worker.HeaderSeq))
	}

	attempts := 0
	for _, s := range spans.Ended() {
		if !strings.HasPrefix(s.Name(), "process ") {
			continue
		}
		attempts++
		if s.Status().Description != pe.Error() {
			t.Errorf("span status %q", s.Status().Description)
		}
		// The partition and the worker, in the messaging conventions'
		// names beside leasehold's.
		attrs := map[string]string{}
		for _, a := range s.Attributes() {
			attrs[string(a.Key)] = a.Value.Emit()
		}
		if attrs["messaging.destination.partition.id"] != "0" || attrs["messaging.client.id"] != "w" || attrs["leasehold.partition"] != "0" || attrs["leasehold.worker"] != "w" {
			t.Errorf("the attempt's span names its partition and worker as %v", attrs)
		}
		found := false
		for _, ev := range s.Events() {
			for _, a := range ev.Attributes {
				if a.Key == "exception.stacktrace" && a.Value.AsString() != "" && strings.Contains(a.Value.AsString(), "panic_test.go") {
					found = true
				}
			}
		}
		if !found {
			t.Errorf("the attempt's span %s has no exception.stacktrace: %+v", s.Name(), s.Events())
		}
	}
	if attempts != 2 {
		t.Errorf("%d attempt spans, want 2", attempts)
	}
}
