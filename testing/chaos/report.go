package chaos

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Report is the JSON form of a result, as `leasehold chaos --json`
// prints it: the figures, and what the run was.
type Report struct {
	Figures
	OK      bool `json:"ok"`
	Settled bool `json:"settled"`
	Cluster bool `json:"cluster"`
	// PartitionConcurrency is the jobs of a partition each worker ran at
	// once.
	PartitionConcurrency int `json:"partition_concurrency"`
	// HTTPUnverified: the HTTP receiver ran without its Verifier.
	HTTPUnverified bool     `json:"http_unverified,omitempty"`
	DurationSec    float64  `json:"duration_s"`
	ElapsedSec     float64  `json:"elapsed_s"`
	Seed           uint64   `json:"seed"`
	Skipped        []string `json:"skipped,omitempty"`
	Violations     []string `json:"violation_list,omitempty"`
	Dir            string   `json:"dir,omitempty"`
}

// Report returns the result's JSON form. cluster and duration describe the
// run's configuration.
func (r *Result) Report(cfg Config) Report {
	rep := Report{
		Figures: r.Figures, OK: r.OK() && r.Settled, Settled: r.Settled, Cluster: cfg.Cluster,
		DurationSec: cfg.Duration.Seconds(), ElapsedSec: r.Elapsed.Round(time.Millisecond).Seconds(),
		Seed: r.Seed, Skipped: r.Skipped, HTTPUnverified: cfg.HTTPUnverified,
	}
	cfg.setDefaults()
	rep.PartitionConcurrency = cfg.PartitionConcurrency
	for i, v := range r.Violations {
		if i == 50 {
			rep.Violations = append(rep.Violations, fmt.Sprintf("... and %d more", len(r.Violations)-i))
			break
		}
		rep.Violations = append(rep.Violations, v.String())
	}
	if !rep.OK {
		rep.Dir = r.Dir
	}
	return rep
}

// WriteJSON writes the report as one JSON object.
func (rep Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// WriteTable writes the report as a figure table, followed by the
// violations, if any.
func (rep Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	kind := "single server"
	if rep.Cluster {
		kind = "3-node cluster"
	}
	fmt.Fprintf(tw, "chaos run\t%s, %d jobs of a partition at once, faults for %.0fs, %.0fs in all, seed %d\n", kind, rep.PartitionConcurrency, rep.DurationSec, rep.ElapsedSec, rep.Seed)
	fmt.Fprintln(tw, "\t")
	fmt.Fprintln(tw, "FAULTS INJECTED\tCOUNT")
	kinds := make([]string, 0, len(rep.Faults))
	total := 0
	for k, n := range rep.Faults {
		kinds = append(kinds, k)
		total += n
	}
	slices.Sort(kinds)
	for _, k := range kinds {
		fmt.Fprintf(tw, "  %s\t%d\n", k, rep.Faults[k])
	}
	fmt.Fprintf(tw, "  total\t%d\n", total)
	fmt.Fprintln(tw, "\t")
	fmt.Fprintln(tw, "ZOMBIE WRITES\t")
	fmt.Fprintf(tw, "  attempted\t%d\n", rep.ZombieAttempted)
	fmt.Fprintf(tw, "  rejected by the sink's fence\t%d\n", rep.ZombieRejected)
	fmt.Fprintf(tw, "  not stored by the effect log (duplicate key, or never sent)\t%d\n", rep.ZombieNotStored)
	fmt.Fprintf(tw, "  applied\t%d\n", rep.ZombieApplied)
	fmt.Fprintf(tw, "forged and garbage messages stored / refused / set aside / applied\t%d / %d / %d / %d\n", rep.Injected, rep.InjectedRefused, rep.InjectedSetAside, rep.InjectedApplied)
	kinds = kinds[:0]
	for k := range rep.InjectedByKind {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	for _, k := range kinds {
		f := rep.InjectedByKind[k]
		fmt.Fprintf(tw, "  %s\t%d / %d / %d / %d\n", k, f.Stored, f.Refused, f.SetAside, f.Applied)
	}
	fmt.Fprintf(tw, "forged copies of a holder's exact stamp applied (the accepted residual)\t%d\n", rep.ForgedResidual)
	fmt.Fprintf(tw, "  jobs whose key holds such a copy instead of their own effect\t%d\n", rep.JobsDisplaced)
	fmt.Fprintln(tw, "\t")
	fmt.Fprintln(tw, "JOBS\t")
	fmt.Fprintf(tw, "  enqueued\t%d\n", rep.JobsEnqueued)
	fmt.Fprintf(tw, "  applied exactly once\t%d\n", rep.JobsApplied-rep.JobsDuplicated)
	fmt.Fprintf(tw, "  lost\t%d\n", rep.JobsLost)
	fmt.Fprintf(tw, "  not yet applied when the run ended\t%d\n", rep.JobsNotApplied)
	fmt.Fprintf(tw, "  duplicated\t%d\n", rep.JobsDuplicated)
	fmt.Fprintf(tw, "  dead-lettered\t%d\n", rep.JobsDeadLettered)
	fmt.Fprintf(tw, "stale applications\t%d\n", rep.StaleApplications)
	if hf := rep.HTTP; hf.Requests > 0 || rep.HTTPUnverified {
		fmt.Fprintln(tw, "\t")
		verifier := "behind a Verifier (fences and keys in KV)"
		if rep.HTTPUnverified {
			verifier = "WITHOUT a Verifier"
		}
		fmt.Fprintf(tw, "HTTP RECEIVER (two relays under one lock, %s)\t\n", verifier)
		fmt.Fprintf(tw, "  enqueued\t%d\n", hf.JobsEnqueued)
		fmt.Fprintf(tw, "  applied exactly once (one request handled per idempotency key)\t%d\n", hf.JobsApplied)
		fmt.Fprintf(tw, "  lost\t%d\n", hf.JobsLost)
		fmt.Fprintf(tw, "  duplicated\t%d\n", hf.JobsDuplicated)
		fmt.Fprintf(tw, "  stale (a zombie's effect, or a superseded relay's request, handled)\t%d\n", hf.Stale)
		fmt.Fprintf(tw, "  dead-lettered (by workers / by the relays)\t%d / %d\n", hf.JobsDeadLettered, hf.RelayDeadLettered)
		fmt.Fprintf(tw, "  forged copies of a holder's exact stamp handled / jobs displaced\t%d / %d\n", hf.ForgedResidual, hf.JobsDisplaced)
		fmt.Fprintf(tw, "  requests: handled / replayed by key / superseded relay refused / 503 while down / other refusals\t%d / %d / %d / %d / %d\n",
			hf.Handled, hf.Replayed, hf.StaleRelayRefused, hf.DownAnswers, hf.OtherRefused)
	}
	fmt.Fprintf(tw, "job attempts completed / failed\t%d / %d\n", rep.AttemptsCompleted, rep.AttemptsFailed)
	fmt.Fprintln(tw, "\t")
	fmt.Fprintf(tw, "FAIL-OVER (%d)\t\n", rep.Failovers)
	fmt.Fprintf(tw, "  p50\t%s\n", msString(rep.FailoverP50Ms))
	fmt.Fprintf(tw, "  p99\t%s\n", msString(rep.FailoverP99Ms))
	fmt.Fprintf(tw, "  max\t%s\n", msString(rep.FailoverMaxMs))
	fmt.Fprintf(tw, "LIVENESS (bound %s)\t\n", msString(rep.LivenessBoundMs))
	longest := msString(rep.LongestStallMs)
	if rep.LongestStallPartition != "" {
		longest += " (partition " + rep.LongestStallPartition + ")"
	}
	fmt.Fprintf(tw, "  longest stall: pending jobs, a live holder, no progress\t%s\n", longest)
	fmt.Fprintf(tw, "  per partition\t%s\n", formatStalls(rep.Stalls))
	fmt.Fprintf(tw, "acquisitions\t%d\n", rep.Acquisitions)
	var ds []string
	for k, n := range rep.Decisions {
		ds = append(ds, fmt.Sprintf("%s %d", k, n))
	}
	slices.Sort(ds)
	fmt.Fprintf(tw, "sink decisions\t%s\n", strings.Join(ds, ", "))
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, s := range rep.Skipped {
		fmt.Fprintf(w, "skipped: %s\n", s)
	}
	switch {
	case len(rep.Violations) > 0:
		fmt.Fprintf(w, "\nCHECK FAILED: %d violations\n", rep.Figures.Violations)
		for _, v := range rep.Violations {
			fmt.Fprintln(w, "  "+v)
		}
	case !rep.Settled:
		fmt.Fprintln(w, "\nCHECK FAILED: the sink did not catch up with every job in time")
	default:
		fmt.Fprintln(w, "\ncheck passed: no stale or unverified application, every job applied exactly once, no effect of an incomplete job attempt applied, epochs rise, one holder per epoch, no partition stalled past the bound; at the HTTP receiver every job handled once, none stale")
	}
	if rep.Dir != "" {
		fmt.Fprintf(w, "history, logs and stores kept in %s\n", rep.Dir)
	}
	return nil
}

func msString(v float64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f ms", v)
}
