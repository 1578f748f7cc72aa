package bench

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkJobEffects runs the all-or-none pipeline with jobs of one and
// of aonEffects effects, the latter packed (worker.Config.PackEffects) and
// not, each alone, for profiling where a job's effects cost:
//
//	go test ./cmd/leasehold/internal/bench -run '^$' -bench 'JobEffects/3' -benchtime 3x -cpuprofile cpu.out
//
// applied_when_stored is the share of the effects the sink runner had
// applied when the last of them was stored: well below 1, the sink set
// the pace and the rest of the run was it catching up.
func BenchmarkJobEffects(b *testing.B) {
	for _, v := range []aonVariant{{1, false}, {aonEffects, false}, {aonEffects, true}} {
		b.Run(fmt.Sprintf("%d%s", v.k, map[bool]string{true: "packed"}[v.pack]), func(b *testing.B) {
			cfg := Config{Runs: 1}
			cfg.setDefaults()
			e, err := startEnv(context.Background(), &cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer e.close()
			var jobs, share float64
			i := 0
			for b.Loop() {
				r, s, err := e.aonRun(context.Background(), fmt.Sprintf("bj%d%s-%d", v.k, packName(v.pack), i), e.pipeJobs(), v.k, v.pack, true)
				if err != nil {
					b.Fatal(err)
				}
				jobs, share = jobs+r, share+s
				i++
			}
			b.ReportMetric(jobs/float64(i), "jobs/s")
			b.ReportMetric(float64(v.k)*jobs/float64(i), "effects/s")
			b.ReportMetric(share/float64(i), "applied_when_stored")
		})
	}
}
