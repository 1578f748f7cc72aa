package coordinator

import "time"

// SetWallClock makes Provision read f instead of the real clock, until the
// returned function is called.
func SetWallClock(f func() time.Time) (restore func()) {
	old := wallClock
	wallClock = f
	return func() { wallClock = old }
}

// Lock key encoding, for its tests.
var (
	EncodeLockName = encodeLockName
	DecodeLockName = decodeLockName
)
