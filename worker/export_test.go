package worker

// Stalls counts the pull requests of w that expired while jobs waited.
func Stalls(w *Worker) int64 { return w.stalls.Load() }
