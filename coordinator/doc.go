// Package coordinator hands out partitions to workers through leases in a
// JetStream key-value bucket, and numbers every acquisition with an epoch.
//
// The contract:
//
//   - A partition's epoch is the revision of the bucket write that acquired
//     it. Revisions come from one counter per bucket that never goes back,
//     also across server restarts and leader fail-over; a bucket is created
//     with a first sequence above every earlier bucket's (see Provision), so
//     epochs keep increasing when the bucket is deleted and re-created.
//   - At most one lease per partition is live on the server: acquisition,
//     renewal and release are compare-and-set writes on the partition's key.
//   - A Lease renews itself. Its Context is cancelled, with a cause matching
//     leasehold.ErrLeaseLost, when a renewal is refused or when its local
//     deadline passes: the send time of the last successful renewal plus the
//     TTL minus a safety margin, on the monotonic clock. A paused process
//     cannot see its own pause, so this is a courtesy, not the safety net:
//     sinks fence by epoch.
//   - Every acquisition also fences the partition's record in the
//     fence-record bucket (<bucket>-fences, durable, no TTL): the record is
//     rewritten under the new epoch and acquisition before the lease is
//     handed out, and a holder's Commit of input progress is a
//     compare-and-set on that record. A former holder can therefore never
//     move progress past work whose effects a sink refused. The record
//     outlives the lease bucket: a lease bucket re-created beside it starts
//     above every epoch it recorded, and progress carries over.
//   - Locks on named resources (Lock, TryLock, RunSingleton) are leases
//     with the same guarantees; a lock's scope is "<scope>/<name>".
//   - IssuedEpoch tells sinks the highest epoch issued for a fence, from
//     the server's revisions of its lease key only.
//   - Records a client left that leasehold never writes (garbage, leases
//     without a TTL) are reported by Findings, repaired by Fence and Repair,
//     and taken over by the worker group once they outlive any lease.
//   - Outcomes that a timeout leaves open are settled by reading the key
//     from the stream leader, never by assuming.
//
// A Coordinator also balances partitions over the live workers without a
// central process: each worker registers a member key with a TTL, computes
// the same sticky, balanced assignment from the bucket's contents, takes the
// partitions assigned to it and hands off the ones it should no longer hold
// after a drain hook. See Coordinator.Run.
package coordinator
