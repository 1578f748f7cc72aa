package leasehold

import "time"

// Lease describes one acquisition of a fence (a job stream's partition or
// a named lock): who took it, when, the epoch it carries and the token that
// tells this acquisition from any other. It is a value; the coordinator
// package keeps the live lease that renews itself and reports its loss.
type Lease struct {
	Scope       string
	Partition   Partition
	Epoch       Epoch
	Acquisition string    // unique to this acquisition
	Holder      string    // the worker ID of the holder
	Acquired    time.Time // the holder's clock when it acquired the lease
}

// Fence is the fence the lease orders.
func (l Lease) Fence() FenceID { return FenceID{Scope: l.Scope, Partition: l.Partition} }

// Stamp is the stamp of a write with idempotency key key made under l.
func (l Lease) Stamp(key string) Stamp {
	return Stamp{Scope: l.Scope, Partition: l.Partition, Epoch: l.Epoch, Acquisition: l.Acquisition, Key: key, Worker: l.Holder}
}
