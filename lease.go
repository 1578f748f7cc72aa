package leasehold

import "time"

// Lease describes one acquisition of a partition: who took it, when, and the
// epoch it carries. It is a value; the coordinator package keeps the live
// lease that renews itself and reports its loss.
type Lease struct {
	Partition Partition
	Epoch     Epoch
	Holder    string    // the worker ID of the holder
	Acquired  time.Time // the holder's clock when it acquired the lease
}
