// Package testleak checks, at the end of a package's tests, that they left
// no goroutine running, as goleak.VerifyTestMain does, but gives goroutines
// that are ending time to end first.
//
// goleak looks again for about half a second. An embedded NATS server
// that a test shut down stops its stores' and its clock's goroutines a
// moment later, and on a loaded machine that moment can be longer, so a
// package whose tests all passed failed on goroutines that were on their
// way out. Here a leak is a goroutine still running a while (Grace) after
// the last test: long enough for a busy scheduler, far too short to hide a
// server or a loop nobody stops.
package testleak

import (
	"fmt"
	"os"
	"time"

	"go.uber.org/goleak"
)

// Grace is how long goroutines have to end after the last test.
const Grace = 30 * time.Second

// TestingM is what VerifyTestMain runs: a *testing.M, or one wrapped (as
// testskip.Summarize does).
type TestingM interface{ Run() int }

// VerifyTestMain runs m's tests and, if they passed, fails the package
// when goroutines are still running Grace after them.
func VerifyTestMain(m TestingM, options ...goleak.Option) {
	options = append(options, serverStores...)
	code := m.Run()
	if code == 0 {
		if err := settle(Grace, options...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run (after waiting %v for goroutines to end): %v\n", Grace, err)
			code = 1
		}
	}
	os.Exit(code)
}

// serverStores are the goroutines of a stream store that nats-server
// v2.15.2 created and never stopped, found twice in the coordinator's
// package after every test had shut its servers down: the store's state
// flush loop and the access-time clock it registered, and nothing else of
// a server (no connection, no JetStream loop). A server a test left
// running still shows by its many other goroutines.
var serverStores = []goleak.Option{
	goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*fileStore).flushStreamStateLoop"),
	goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server/ats.Register.func1"),
}

// settle looks for leaked goroutines until none is left or grace has
// passed, and returns the last finding.
func settle(grace time.Duration, options ...goleak.Option) error {
	deadline := time.Now().Add(grace)
	for {
		err := goleak.Find(options...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}
