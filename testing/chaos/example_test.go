package chaos_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/leasehold/leasehold/testing/chaos"
)

// A test of your own can run the harness against a leasehold binary (build
// it with `go build github.com/leasehold/leasehold/cmd/leasehold`) and
// fail on what the checker finds.
func ExampleRun() {
	res, err := chaos.Run(context.Background(), chaos.Config{
		Binary:   "/usr/local/bin/leasehold",
		Duration: 30 * time.Second,
		Faults:   []string{chaos.FaultPause, chaos.FaultKill, chaos.FaultNATSRestart},
	})
	if err != nil {
		fmt.Println("the run could not be carried out:", err)
		return
	}
	for _, v := range res.Violations {
		fmt.Println(v) // check, partition, epoch, key, and the history excerpt
	}
	_ = res.Report(chaos.Config{Duration: 30 * time.Second}).WriteTable(os.Stdout)
}

// Check judges any history, for example one recorded by your own
// processes with the same event kinds.
func ExampleCheck() {
	a := chaos.Check(chaos.Input{Prefix: "orders"})
	fmt.Println(a.OK(), a.JobsEnqueued)
	// Output: true 0
}
