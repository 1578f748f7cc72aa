// Package leasehold holds the vocabulary shared by every part of the
// framework: scopes, partitions, epochs, leases, the stamp every effect
// carries, the header names that carry it, and the errors a fenced write
// can return.
//
// A worker owns a partition of a job stream (or a named lock) through a
// lease. The revision of the write that acquired the lease is its epoch:
// every later acquisition of the same partition gets a higher one.
// Everything a worker writes is stamped with (scope, partition, epoch,
// acquisition, idempotency key), and a sink refuses a stamp whose epoch is
// below the highest it has accepted for that scope and partition, or equal
// to it but from another acquisition. That refusal is ErrStaleEpoch; it is
// how a worker that was paused past its lease finds out, too late to do
// harm, that somebody else owns its partition.
//
// The scope is the fence's namespace: a job stream's prefix for its
// partitions, "<namespace>/<name>" for a lock (LockScope). A sink keeps one
// fence per FenceID, so any number of job streams and locks can share it
// without one's epochs refusing, or admitting, another's writes. The
// acquisition token tells two acquisitions apart that a lease bucket which
// lost acknowledged writes handed the same revision (Judge refuses the
// second as a split brain).
//
// Parsing is strict on purpose. An epoch that is missing, empty, signed,
// padded, zero or larger than MaxEpoch is an error, never a zero value: a
// garbled header must not be able to pass as the oldest (or the newest)
// epoch. A missing or malformed scope or acquisition is an error too.
//
// # Layers
//
// The module is built in floors, and a package imports only its own floor
// and the ones below it (layers_test.go checks every import):
//
//  1. this package: the vocabulary;
//  2. internal/: helpers the floors above share (retries, leader reads,
//     batch publishes, embedded servers, processes);
//  3. coordinator: leases, epochs, membership, fenced progress;
//  4. telemetry: instrumentation every floor above may use;
//  5. sink and sink/*: fences and the sinks;
//  6. worker and worker/*: the SDK handlers are written with;
//  7. tools that read the SDK: statuspage, testing/*, and the benchmark
//     engine in cmd/leasehold/internal;
//  8. programs: cmd/, examples/, deploy/.
package leasehold
