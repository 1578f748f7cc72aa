package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/worker"
)

// A dead letter's reason is a header of a message in the dead-letter
// stream, which anyone allowed to publish there can write, escape
// sequences included; `jobs show` prints it to a terminal.
func TestJobsShowQuotesControlBytes(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	sts := []worker.JobStatus{
		{Ref: "0:1", Seq: 1, State: worker.JobDeadLettered, DeadLetter: 3, Error: "boom\x1b]0;owned\x07\x1b[2J"},
		{Ref: "0:2", Seq: 2, State: worker.JobUnknown, Detail: "a message on jobs.jobs.\x1b[31m"},
	}
	if err := printJobs(&out, sts, false); err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(out.String(), "\x1b\x07") {
		t.Errorf("jobs show prints control bytes raw:\n%q", out.String())
	}
}
