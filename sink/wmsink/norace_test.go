//go:build !race

package wmsink_test

const raceDetector = false
