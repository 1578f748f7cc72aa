//go:build !race

package streamsink

const raceDetector = false
