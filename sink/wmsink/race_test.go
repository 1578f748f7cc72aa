//go:build race

package wmsink_test

// raceDetector is set when the tests run under the race detector.
const raceDetector = true
