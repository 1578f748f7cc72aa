package telemetry

import (
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// ParentDecides wraps tp as Setup does when its sampler follows the
// parent, so that tests can run a provider with a recorder of their own
// the way Setup hands it out.
func ParentDecides(tp trace.TracerProvider) trace.TracerProvider { return &parentDecides{tp: tp} }

// FollowsParent is followsParent, for tests.
func FollowsParent(s sdktrace.Sampler) bool { return followsParent(s) }
