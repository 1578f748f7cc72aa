package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
)

// The demo, as a newcomer runs it but with --json: a worker is frozen past
// its TTL and really writes when it wakes up; the sink refuses it; nothing
// is lost and nothing stale is applied.
func TestDemoJSON(t *testing.T) {
	t.Parallel()
	defer oneFleet(t)()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := run(t, ctx, "demo", "--json", "--duration", "20s", "--jobs", "600", "--workers", "3", "--partitions", "6")
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	var sum demoSummary
	if err := json.Unmarshal([]byte(out), &sum); err != nil {
		t.Fatalf("demo --json printed something that is not one JSON object: %v\n%s", err, out)
	}
	t.Logf("%+v", sum)
	// On a busy machine the 20 s may end before every job is enqueued or
	// run: those are unfinished, not lost. Lost is committed and not
	// applied, and never happens.
	if sum.JobsLost != 0 || sum.JobsProcessed == 0 || sum.JobsProcessed+sum.JobsUnfinished != sum.JobsEnqueued {
		t.Errorf("jobs: %d enqueued, %d processed, %d unfinished, %d lost", sum.JobsEnqueued, sum.JobsProcessed, sum.JobsUnfinished, sum.JobsLost)
	}
	if sum.StaleApplied != 0 {
		t.Errorf("%d stale effects applied", sum.StaleApplied)
	}
	if sum.ZombiePauses != 1 || sum.EffectsRejectedStale == 0 {
		t.Errorf("zombie: %d pauses, %d writes refused; want 1 pause and a refused write", sum.ZombiePauses, sum.EffectsRejectedStale)
	}
	for _, r := range sum.Rejected {
		if r.Epoch >= r.Max || r.Worker != sum.ZombieWorker {
			t.Errorf("rejection %+v is not a stale write of the frozen worker %s", r, sum.ZombieWorker)
		}
		if !strings.HasSuffix(fmt.Sprint(r.Epoch), strings.TrimPrefix(r.EpochShort, "…")) || !strings.HasSuffix(fmt.Sprint(r.Max), strings.TrimPrefix(r.MaxShort, "…")) || len(r.EpochShort) != len("…1234") {
			t.Errorf("rejection %+v: the short epochs are not the last 4 digits", r)
		}
	}
	// The frozen worker's partitions were taken over, each reported with
	// its new holder and epoch.
	fromZombie := 0
	for _, tk := range sum.Takeovers {
		if tk.From == tk.To || tk.To == "" || tk.Epoch == 0 || !strings.HasSuffix(fmt.Sprint(tk.Epoch), strings.TrimPrefix(tk.EpochShort, "…")) {
			t.Errorf("take-over %+v", tk)
		}
		if tk.From == sum.ZombieWorker {
			fromZombie++
		}
	}
	if fromZombie == 0 {
		t.Errorf("no take-over of the frozen worker %s's partitions reported: %+v", sum.ZombieWorker, sum.Takeovers)
	}
	for _, key := range []string{"jobs_enqueued", "jobs_processed", "jobs_lost", "jobs_unfinished", "effects_accepted", "effects_rejected_stale", "stale_applied", "zombie_pauses"} {
		if !strings.Contains(out, `"`+key+`"`) {
			t.Errorf("summary lacks %s", key)
		}
	}
}

func TestDemoRefusesBadFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, args := range [][]string{
		{"demo", "--workers", "1"},
		{"demo", "--ttl", "1500ms"},
		{"demo", "--duration", "5s"},
		{"demo", "--jobs", "0"},
	} {
		if _, err := run(t, ctx, args...); err == nil {
			t.Errorf("%v: want an error", args)
		}
	}
}
