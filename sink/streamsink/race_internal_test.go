//go:build race

package streamsink

// raceDetector is set when the tests run under the race detector, which
// makes JSON and the embedded server some ten times slower.
const raceDetector = true
