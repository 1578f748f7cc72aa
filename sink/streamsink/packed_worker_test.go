package streamsink_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// A worker that packs its effects (worker.Config.PackEffects) and a
// runner that verifies epochs and reads committed progress, as `leasehold
// sink` runs it: each job's three effects leave in one log message and
// are applied once, all in one handler call; an attempt that fails after
// emitting sends nothing, and its retry applies.
func TestPackedFromWorker(t *testing.T) {
	t.Parallel()
	js, replicas := startTopo(t, "single")
	const prefix = "pkw"
	bucket := provisionJobs(t, js, prefix, replicas)
	pl := newPackLog(t, js, prefix, leasehold.StampCompact)
	pl.cfg.Verifier = bucket
	r := start(t, js, pl.cfg)
	var mu sync.Mutex
	tries := map[uint64]int{}
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		tries[j.Seq]++
		n := tries[j.Seq]
		mu.Unlock()
		for i := range 3 {
			if i == 2 && string(j.Data) == "job-3" && n == 1 {
				return errors.New("the third effect's write failed")
			}
			if err := j.Emit(ctx, fmt.Appendf(nil, "%d/%d/%d", j.Seq, i, n)); err != nil {
				return err
			}
		}
		return nil
	})
	cfg := workerConfig(js, prefix, bucket, "w1", h)
	events := make(chan worker.Event, 4096)
	cfg.PackEffects, cfg.MaxAttempts, cfg.Observer = true, 3, forwardEvents(events)
	runWorker(t, cfg)
	ctx := ctxFor(t, 2*time.Minute)
	seqs := enqueueJobs(t, ctx, js, prefix, 10)
	awaitCommitted(t, ctx, events, seqs[len(seqs)-1])
	settleLog(t, js, prefix, r)

	want := map[string][]string{}
	for _, seq := range seqs {
		n := 1
		if seq == seqs[3] {
			n = 2
		}
		for i := range 3 {
			want[leasehold.EffectKey(prefix, 0, seq, i)] = []string{fmt.Sprintf("%d/%d/%d", seq, i, n)}
		}
	}
	got := pl.applied()
	for k, w := range want {
		if !slices.Equal(got[k], w) {
			t.Errorf("effect %s applied as %q, want %q", k, got[k], w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d effects applied, want %d", len(got), len(want))
	}
	for _, call := range pl.callsOf() {
		if len(call)%3 != 0 {
			t.Errorf("a handler call holds %v: part of a job", call)
		}
	}
	packs, effects := 0, 0
	for _, m := range readLog(t, js, worker.EffectsStream(prefix)) {
		if n, err := leasehold.PackCount(m.Header); err == nil && n > 0 {
			packs++
			continue
		}
		if mark, err := leasehold.JobMarkFromHeader(m.Header); err == nil && !mark.Standalone() {
			effects++
		}
	}
	if packs != len(seqs) || effects != 0 {
		t.Errorf("the log holds %d packed messages and %d effects alone or markers, want %d and 0", packs, effects, len(seqs))
	}
	pl.mu.Lock()
	defer pl.mu.Unlock()
	for _, d := range pl.decisions {
		if d.Suspect != "" || d.Err != nil {
			t.Errorf("decision %+v", d)
		}
	}
}
