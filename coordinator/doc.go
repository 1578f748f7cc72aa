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
//   - VerifyAcquisition tells sinks whether an epoch was issued to a fence
//     with a given acquisition token: the fence record names the pair, and
//     the lease key's revisions allow it (IssuedEpoch is that bound).
//     Committed reads a partition's committed progress from its fence
//     record, for sinks that drop a job's effects only on proof.
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
//
// # Member sessions
//
// By default the partition leases Run holds live by the worker's member
// registration, its session, instead of renewing one by one; the worker
// renews only member.<worker>, so the bucket's idle write rate is about
// W × 3 / TTL for W workers, whatever the partition count. The rules:
//
//   - A session is one registration, named by the revision of the write
//     that acquired member.<worker>; every renewal (a compare-and-set on
//     the last revision, carrying the TTL) repeats it in the record.
//   - A session-held partition record names its holder and session
//     ("session" in the JSON), carries no per-message TTL and names a TTL
//     of about 70 years ("ttl_ms"). It is written only to acquire (its
//     revision is the epoch, as before) and to release (a revision-checked
//     purge). The fence record is fenced on acquisition exactly as for a
//     lease that renews itself.
//   - A taker overwrites such a record only after reading member.<holder>
//     through the stream leader and finding no value, a marker, or another
//     session; and then by compare-and-set on the partition record's
//     revision. An ended session never comes back: its renewal expects a
//     revision the marker or the new registration moved, and a new
//     registration is a new session that holds nothing. So at most one
//     session holds a partition live on the server (I2), and epochs still
//     increase strictly (I1).
//   - Every partition lease of a session has the session's local deadline
//     (last successful renewal of the registration sent + TTL − margin) and
//     ends with it (I6); while the worker watches the partition records
//     (below), a lease also ends when the watch shows another write on its
//     record (an operator's Fence, a take-over). Lease's
//     Context, Done, Err and Deadline work as for a lease that renews
//     itself; Renew renews the session.
//   - A worker that leaves drains and releases its partitions first and
//     deregisters last. A record this worker's session still holds but
//     does not (a release that failed) is purged when the assignment gives
//     the partition to another worker.
//
// # Holdings in the registration
//
// A session's registration also lists the partitions its worker holds
// ("holds": the ascending partition numbers as delta-encoded uvarints in
// unpadded URL base64), written after each change is stored, a release's
// purge first; renewals repeat the last list. While every live member
// lists its holdings, Run watches member.> only: each worker's watch
// receives the members' writes, whatever the partition count, and the
// shared assignment is computed from the lists. A live member without a
// list (RenewPartitions, a release before lists, a list that does not
// decode) makes every worker of this version watch the partition records
// too, as before, until it leaves. Without the partition records:
//
//   - an acquisition that finds a partition held is retried when the
//     holder's list changes, or after a renewal interval;
//   - a record this worker's session may have left behind (a release that
//     failed, an acquisition whose outcome it gave up on) is read through
//     the leader and purged when the assignment gives the partition to
//     another worker;
//   - a record of a live session that its holder has not listed, in lists
//     written after it, for longer than a list can lag (TTL + max(TTL/2,
//     1 s) + 1 s + the request timeout), is overwritten by compare-and-set
//     on exactly its revision: its holder does not hold it;
//   - a record leasehold did not write is taken over once it has stayed
//     unchanged for TTL + max(TTL/2, 1 s). Nobody saw it written, so it
//     is dated by the watch: an entry of a later revision, seen at t,
//     proves the record has stood since t (a worker watching the
//     partition records counts from when it saw it written). Garbage
//     written over a held partition's record long ago therefore delays
//     neither its hand-off nor its fail-over;
//   - a registration whose list would not fit in a message the server
//     takes lists none, and so brings the partition watch back;
//   - an operator's Fence of a held partition leaves its holder a notice
//     (notice.<holder>, naming the partition and the epoch removed, with a
//     per-message TTL); the holder, which watches its own notice key, ends
//     the lease once the stream leader shows the record gone or replaced.
//     A Fence by a release before notices is noticed at the partition's
//     next progress commit, which the fence refuses.
//
// # Acquisitions in atomic batches
//
// Once its membership has settled, a session member takes the partitions
// it is given in JetStream atomic batches of up to 256: their records in
// one batch, then their fence records in another (both buckets allow
// atomic publish; Provision turns it on in buckets made before). Every
// message is a compare-and-set on its own key and the server stores a
// batch whole or not at all, at consecutive revisions in order, so each
// epoch is still the revision of the write that acquired its partition;
// the first and last records are read back through the stream leader to
// check that before a lease is handed out. A batch refused because a
// record was not at the expected revision is read through the leader and
// sent again with the free records only; what no batch takes is acquired
// one by one with the record the batch tried, which settles a batch whose
// answer was lost. With sync_interval always one batch costs one fsync
// where each write would cost its own.
//
// Config.RenewPartitions turns sessions off for a worker: its partition
// leases renew themselves. Locks (Lock, TryLock, RunSingleton) and leases
// taken with Acquire always renew themselves.
//
// Mixed fleets. Workers of this version, with sessions or without, share a
// bucket: each understands both kinds of record, never takes a lease that
// renews itself before it expires or is released, and takes a
// session-held one only once its session ended. Workers of releases
// before sessions read a session-held record as one without a TTL that
// names a TTL of 70 years: they do not take it over (they log a warning
// once per record) and hold their own partitions as before, so nothing is
// held twice, but they never take over a partition from a session that
// ended either: until every worker is upgraded, partitions of a session
// member that crashed wait for one of this version. Their `leasehold
// status` reports such records as foreign, and their `leasehold fence`
// would remove them: fence with this version's tool. Releases before
// lists ignore the "holds" field; while one is a member, this version
// watches the partition records as they do. The bucket's format is
// otherwise unchanged; a rolling upgrade needs no migration.
package coordinator
