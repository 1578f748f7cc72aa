package streamsink_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink/streamsink"
)

// BenchmarkRepublishJobs republishes a backlog of 1000 jobs of three
// effects each into the downstream stream, each job in one atomic batch
// (Config.AtomicJobs) or its effects one by one, on one server and on a
// three-node cluster with every stream at three replicas:
//
//	go test ./sink/streamsink -run '^$' -bench RepublishJobs -benchtime 3x
func BenchmarkRepublishJobs(b *testing.B) {
	for _, topo := range []string{"server", "cluster"} {
		for _, atomic := range []bool{false, true} {
			name := map[bool]string{false: "one-by-one", true: "atomic"}[atomic]
			b.Run(topo+"/"+name, func(b *testing.B) {
				js, replicas := startTopo(b, topo)
				var total time.Duration
				runs := 0
				for b.Loop() {
					scope := fmt.Sprintf("rj%d", runs)
					cfg := streamsink.Config{Prefix: scope, Provision: true, Replicas: replicas, AtomicJobs: atomic, MaxBackoff: 10 * time.Millisecond, Logger: quiet()}
					wl := &wireLog{t: b, js: js, scope: scope, cfg: cfg}
					rn, err := streamsink.New(ctxFor(b, time.Minute), js, cfg)
					if err != nil {
						b.Fatal(err)
					}
					var last uint64
					for job := uint64(1); job <= 1000; job++ {
						wl.effect(job, 1, 0)
						wl.effect(job, 1, 1)
						last = wl.final(job, 1, 2, job-1)
					}
					t0 := time.Now()
					r := run(b, rn)
					if err := r.WaitPosition(ctxFor(b, time.Minute), last); err != nil {
						b.Fatal(err)
					}
					total += time.Since(t0)
					runs++
					_ = r.stop()
					_ = js.DeleteStream(ctxFor(b, time.Minute), cfg.Prefix+"-fenced")
				}
				b.ReportMetric(float64(3000*runs)/total.Seconds(), "effects/s")
			})
		}
	}
}
