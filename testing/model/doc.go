// Package model holds a Promela model of leasehold's fencing protocol
// (leasehold.pml, worker.pml, sink.pml, env.pml) and the test that checks it
// with SPIN: exhaustively for small sizes, and once for each known defect put
// back, which must give a counterexample. README.md says what is modelled and
// maps every model variable and step to the Go code it stands for.
//
// The test needs spin and gcc on PATH; without them it skips, unless the
// environment variable LEASEHOLD_REQUIRE_SPIN=1 makes it fail.
// LEASEHOLD_MODEL=large adds the larger configurations (task model).
package model
