package chaos

import (
	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
)

// Event is one line of a process's history: what a producer enqueued, what
// a worker acquired, lost, released, emitted and committed, what a sink
// decided, and what the harness injected.
type Event = history.Event

// Kinds of events, as Event.Kind holds them.
const (
	KindEnqueue  = history.Enqueue  // the producer stored a job (Partition, Seq, JobID)
	KindAcquire  = history.Acquire  // a worker acquired a partition (Partition, Epoch)
	KindLose     = history.Lose     // a worker lost a partition (Partition, Epoch, Reason)
	KindRelease  = history.Release  // a worker released a partition (Partition, Epoch)
	KindEffect   = history.Effect   // a worker sent an effect (Partition, Epoch, Key, Seq)
	KindDecision = history.Decision // a sink decided on an effect (Partition, Epoch, Key, Outcome, Max, Position)
	KindCommit   = history.Commit   // a worker committed progress (Partition, Epoch, Seq)
	KindFault    = history.Fault    // the harness injected a fault (Proc: target, Reason: what)
	KindAttempt  = history.Attempt  // an attempt of a job ended (Partition, Epoch, Seq, Attempt, Outcome)
)

// ApplyStage is the Reason of a decision taken by the destination a sink
// runner applies to (the deduping KV sink) rather than by the runner that
// fences the log. The checker counts applications per key from these.
const ApplyStage = "apply"

// Faults the harness injects; Event.Reason of a KindFault event.
const (
	// FaultPause stops a worker with SIGSTOP for longer than the lease TTL
	// and continues it: the zombie maker. A write-behind worker paused in
	// the middle of a job writes with its old epoch when it wakes.
	FaultPause = "pause"
	// FaultKill kills a worker with SIGKILL; a new one starts.
	FaultKill = "kill"
	// FaultTerm stops a worker with SIGTERM (a graceful drain); a new one
	// starts.
	FaultTerm = "term"
	// FaultSinkKill kills the sink runner with SIGKILL and restarts it.
	FaultSinkKill = "sink_kill"
	// FaultSinkTerm stops the sink runner with SIGTERM and restarts it.
	FaultSinkTerm = "sink_term"
	// FaultNATSRestart stops the single NATS server and starts it again on
	// its store: every client loses its connection. The next fault waits
	// until the server has acknowledged an enqueue (up to 30 s).
	FaultNATSRestart = "nats_restart"
	// FaultNodeKill stops one node of the cluster and restarts it later.
	FaultNodeKill = "node_kill"
	// FaultPartition cuts a worker off the network (network namespace and
	// nftables drop rules) for longer than the TTL, then heals.
	FaultPartition = "partition"
	// FaultForged publishes effects with forged epochs into the effect log:
	// epochs the lease bucket never issued, and epochs below the
	// partition's fence.
	FaultForged = "forged_epoch"
	// FaultGarbage publishes garbage into the effect log: no stamp,
	// malformed epochs and keys, random payloads.
	FaultGarbage = "garbage"
	// FaultLeaseGarbage writes records leasehold never writes into the
	// lease bucket, by blind puts without a TTL: at a partition's lease
	// key, at a member key, and at a key leasehold does not use.
	FaultLeaseGarbage = "lease_garbage"
	// FaultPreempt publishes, before a pending job's effect is sent,
	// messages with no valid stamp under the message IDs the job's effect
	// would have had if they were derived from its key and epoch alone:
	// a worker must not take the log's "duplicate" answer for its own
	// effect stored.
	FaultPreempt = "msgid_preempt"
	// FaultForgedMarker publishes into the effect log what an attacker with
	// a worker's credentials can make of what it reads there and in the
	// lease bucket: abort markers and finals copied from real effects of
	// jobs, a barrier and an effect with a live holder's epoch and a
	// made-up acquisition token, and an effect stamped with an epoch the
	// bucket issued to another fence (see forgery.go). Each message counts
	// as one fault; the injection event's Outcome names its variant.
	FaultForgedMarker = "forged_marker"
	// FaultRelayPause stops the HTTP relay that holds the relay lock with
	// SIGSTOP while a request of its is on the wire (the receiver holds
	// it), until the other relay holds the lock and has delivered; the
	// held request then reaches the Verifier, which must refuse it, and
	// the paused relay is continued. Without a request to catch, a relay
	// is paused past the lock's TTL.
	FaultRelayPause = "relay_pause"
	// FaultRelayKill kills an HTTP relay with SIGKILL; a new one starts.
	FaultRelayKill = "relay_kill"
	// FaultReceiverDown takes the HTTP receiver down for a while: it
	// answers 503, or refuses connections.
	FaultReceiverDown = "receiver_down"
)

// Records of the harness that end a fault or restart what it stopped; they
// are KindFault events too but are not counted as faults.
const (
	markResume      = "resume"
	markRestart     = "restart"
	markHeal        = "heal"
	markNodeRestart = "node_restart"
)

// faultKinds are the Reasons counted as injected faults.
var faultKinds = map[string]bool{
	FaultPause: true, FaultKill: true, FaultTerm: true, FaultSinkKill: true, FaultSinkTerm: true,
	FaultNATSRestart: true, FaultNodeKill: true, FaultPartition: true, FaultForged: true, FaultGarbage: true,
	FaultLeaseGarbage: true, FaultPreempt: true, FaultForgedMarker: true,
	FaultRelayPause: true, FaultRelayKill: true, FaultReceiverDown: true,
}

// removesHolder reports whether a fault takes a worker's partitions away
// from it, so that a fail-over follows.
func removesHolder(reason string) bool {
	switch reason {
	case FaultPause, FaultKill, FaultTerm, FaultPartition:
		return true
	}
	return false
}

// LogEntry is one message of the effect log, read back after the run.
type LogEntry struct {
	Position uint64
	Subject  string
	Stamp    leasehold.Stamp // zero when BadStamp
	Barrier  bool
	BadStamp bool
	// Mark is what the entry says of its job (zero: it stands alone);
	// BadMark when that cannot be read.
	Mark    leasehold.JobMark
	BadMark bool
}

// Job is one job of the job stream.
type Job struct {
	Partition leasehold.Partition
	Seq       uint64
	ID        string
}
