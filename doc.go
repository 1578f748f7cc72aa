// Package leasehold holds the vocabulary shared by every part of the
// framework: partitions, epochs, leases, the stamp every effect carries, the
// header names that carry it, and the errors a fenced write can return.
//
// A worker owns a partition through a lease. The revision of the write that
// acquired the lease is the partition's epoch: every later acquisition of the
// same partition gets a higher one. Everything a worker writes is stamped
// with (partition, epoch, idempotency key), and a sink refuses a stamp whose
// epoch is below the highest it has accepted for that partition. That refusal
// is ErrStaleEpoch; it is how a worker that was paused past its lease finds
// out, too late to do harm, that somebody else owns its partition.
//
// Parsing is strict on purpose. An epoch that is missing, empty, signed,
// padded, zero or larger than MaxEpoch is an error, never a zero value: a
// garbled header must not be able to pass as the oldest (or the newest)
// epoch.
package leasehold
