package streamsink

// Reasons the runner sets a message with job headers aside as suspicious,
// as sink.Decision.Suspect and the leasehold_reason label of
// leasehold_sink_markers_suspicious_total spell them. None is something a
// worker writes; each is what a copy of a real message with its markers
// changed looks like. The message is counted, logged and marked on its
// span, and changes nothing the worker's own messages decide.
const (
	// SuspectAbortBeforeFinal: an abort marker of an attempt whose final
	// came after it. A worker sends an abort only once an attempt is over,
	// and never a final after it: the final wins, and the attempt applies.
	SuspectAbortBeforeFinal = "abort_before_final"
	// SuspectAbortUnknown: an abort marker of an attempt numbered above
	// every attempt the runner has seen of the lease on the subject. A
	// worker sends an abort after its attempt's effects: the marker closes
	// nothing. (After a restart, a real abort whose attempt the runner had
	// already settled can look the same, rarely.)
	SuspectAbortUnknown = "abort_unknown"
	// SuspectAttemptOrder: an attempt of a job that first appears after a
	// higher-numbered attempt of the same job. A worker numbers its
	// attempts in the order it runs them: it ranks after the attempts that
	// came before it, and cannot pre-empt them.
	SuspectAttemptOrder = "attempt_order"
	// SuspectFinalConflict: a second final of one attempt that differs
	// from the first (another count of effects, another previous job,
	// another key). The first stands.
	SuspectFinalConflict = "final_conflict"
	// SuspectFinalKey: a final whose key the attempt already holds as one
	// of its other effects. A worker's final is an effect of its own: it
	// is not taken as the final.
	SuspectFinalKey = "final_key"
	// SuspectOverCount: an attempt holds more effects than its final
	// counts. It is applied whole, since which of them is not the
	// worker's cannot be told.
	SuspectOverCount = "over_count"
	// SuspectJobKey: an effect whose idempotency key names another job
	// than its job headers (a worker's keys are leasehold.EffectKey of its
	// job). It is not applied.
	SuspectJobKey = "job_key"
	// SuspectAfterCommit: an effect of a job whose lease, the fence record
	// shows, will commit no more of it, in an attempt that first appears
	// after the runner had read every effect that lease could commit. It
	// is not applied.
	SuspectAfterCommit = "after_commit"
)
