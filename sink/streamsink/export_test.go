package streamsink

// SetHook makes the runner call f at named points of each batch
// ("delivered": accepted effects republished, progress not saved;
// "saved": progress saved, messages not acked). An error from f stops Run
// there, as a crash would.
func (r *Runner) SetHook(f func(point string) error) { r.hook = f }
