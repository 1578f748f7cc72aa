package telemetry

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// DefaultSampleRatio is the share of new traces DefaultSampler records.
const DefaultSampleRatio = 0.1

// DefaultSampler is the sampler Setup uses when neither its config nor the
// environment names one: the decision of a job's enqueuer where the job
// carries one (so a trace is recorded whole or not at all), and one in
// ten of the traces that start here. Setup wraps it with KeepRefusals.
func DefaultSampler() sdktrace.Sampler {
	return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(DefaultSampleRatio))
}

// KeepRefusals returns a sampler that samples every span started with
// error.type=stale_epoch, and leaves every other decision to base. A sink
// starts such a span for a refused write whose own trace was not sampled
// (a trace of its own, linked to the zombie's span), so with KeepRefusals
// an engineer chasing a zombie finds the refusal however low the sampling
// rate. Setup wraps its sampler with it.
func KeepRefusals(base sdktrace.Sampler) sdktrace.Sampler { return keepRefusals{base} }

type keepRefusals struct{ base sdktrace.Sampler }

func (k keepRefusals) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	for _, a := range p.Attributes {
		if a.Key == semconv.ErrorTypeKey && (a.Value.AsString() == ErrorTypeStaleEpoch || a.Value.AsString() == ErrorTypeSplitBrain) {
			return sdktrace.SamplingResult{
				Decision:   sdktrace.RecordAndSample,
				Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState(),
			}
		}
	}
	return k.base.ShouldSample(p)
}

func (k keepRefusals) Description() string { return "KeepRefusals{" + k.base.Description() + "}" }

// samplerFromEnv reads OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG as
// the OpenTelemetry specification defines them; nil means unset. The SDK
// reads them only when given no sampler, and Setup always gives it one.
func samplerFromEnv() (sdktrace.Sampler, error) {
	name := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER")))
	arg := strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER_ARG"))
	ratio := func() (sdktrace.Sampler, error) {
		if arg == "" {
			return sdktrace.TraceIDRatioBased(1), nil
		}
		v, err := strconv.ParseFloat(arg, 64)
		if err != nil || v < 0 || v > 1 {
			return nil, fmt.Errorf("telemetry: OTEL_TRACES_SAMPLER_ARG=%q: use a ratio from 0 to 1", arg)
		}
		return sdktrace.TraceIDRatioBased(v), nil
	}
	switch name {
	case "":
		return nil, nil
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "traceidratio":
		return ratio()
	case "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "parentbased_traceidratio":
		s, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.ParentBased(s), nil
	}
	return nil, fmt.Errorf("telemetry: OTEL_TRACES_SAMPLER=%q: use always_on, always_off, traceidratio or their parentbased_ forms", name)
}
