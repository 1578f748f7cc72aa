package streamsink

// SetHook makes the runner call f at named points of each batch
// ("delivered": accepted effects republished, progress not saved;
// "saved": progress saved, messages not acked). An error from f stops Run
// there, as a crash would. f is also called, from the fetcher's goroutine,
// with "fetch" before each pull, where an error fails the pull, and with
// "wait" when the fetcher waits for what it fetched to be taken.
func (r *Runner) SetHook(f func(point string) error) { r.hook = f }

// SetMaxDelta sets how many chains the position record lists before the
// applied shards are written, until the returned func restores it.
func SetMaxDelta(n int) func() {
	old := maxDelta
	maxDelta = n
	return func() { maxDelta = old }
}

// SetMaxAbove sets how many jobs a chain may hold applied above its floor,
// until the returned func restores it.
func SetMaxAbove(n int) func() {
	old := maxAbove
	maxAbove = n
	return func() { maxAbove = old }
}
