package streamsink

import (
	"context"
	"fmt"
	"log/slog"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// BenchmarkDecidePacked measures the runner's decisions for jobs of three
// effects, per job, as a worker writes them by default (the compact
// stamp and mark, trace context on each effect): sent as three messages
// ("separate"), or packed in one ("packed"). Jobs in order on 16
// partitions; each job's three effects are applied together.
func BenchmarkDecidePacked(b *testing.B) {
	const parts, per = 16, 3
	data := make([]byte, 256)
	trace := []string{"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	stamp := func(p leasehold.Partition, job uint64, i int) leasehold.Stamp {
		return leasehold.Stamp{Scope: "bench", Partition: p, Epoch: 5, Acquisition: "a5", Key: leasehold.EffectKey("bench", p, job, i), Worker: "w1"}
	}
	mark := func(job uint64, i int) leasehold.JobMark {
		if i == per-1 {
			return leasehold.JobMark{Job: job, Attempt: 1, Effects: per, After: job - 1}
		}
		return leasehold.JobMark{Job: job, Attempt: 1}
	}
	jobs := 1 << 13
	separate := make([]*logMsg, 0, jobs*per)
	packed := make([]*logMsg, 0, jobs)
	for n := range jobs {
		p := leasehold.Partition(n % parts)
		job := uint64(n/parts + 1)
		subject := fmt.Sprintf("bench.out.%d", p)
		var body []byte
		for i := range per {
			h := nats.Header{"Traceparent": trace}
			stamp(p, job, i).SetHeaderAs(h, leasehold.StampCompact)
			mark(job, i).SetHeaderAs(h, leasehold.StampCompact)
			h[nats.MsgIdHdr] = []string{"x"}
			separate = append(separate, &logMsg{seq: uint64(len(separate) + 1), subject: subject, header: h, data: data})
			body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: stamp(p, job, i).Key, Header: map[string][]string{"Traceparent": trace}, Data: data})
		}
		h := nats.Header{}
		stamp(p, job, per-1).SetHeaderAs(h, leasehold.StampCompact)
		mark(job, per-1).SetHeaderAs(h, leasehold.StampCompact)
		leasehold.SetPackHeader(h, per)
		h[nats.MsgIdHdr] = []string{"x"}
		packed = append(packed, &logMsg{seq: uint64(len(packed) + 1), subject: subject, header: h, data: body})
	}
	for _, bc := range []struct {
		name string
		msgs []*logMsg
		each int // messages per job
	}{{"separate", separate, per}, {"packed", packed, 1}} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := Config{Prefix: "bench", Logger: slog.New(slog.DiscardHandler)}
			cfg.setDefaults()
			var r *Runner
			reset := func() {
				r = &Runner{cfg: cfg, rep: sink.NewReporter(sink.ReporterConfig{Name: "b", Logger: cfg.Logger}), fences: newFenceTable(numShards), groups: newGroups()}
				for p := range leasehold.Partition(parts) {
					r.fences.add(leasehold.FenceID{Scope: "bench", Partition: p}, rise{Epoch: 5, Acquisition: "a5"})
				}
			}
			reset()
			ctx := context.Background()
			w := &work{}
			var outs []outcome
			b.ReportAllocs()
			// CPU time besides wall time: on a machine shared with other
			// work, wall time per job measures the others as much.
			cpu0 := cpuTime()
			for n := 0; b.Loop(); n++ {
				if n%jobs == 0 && n > 0 {
					b.StopTimer()
					reset()
					b.StartTimer()
				}
				outs = outs[:0]
				for i := range bc.each {
					m := bc.msgs[(n%jobs)*bc.each+i]
					w.seq = m.seq - 1
					if err := r.decideLog(ctx, w, m, &outs); err != nil {
						b.Fatal(err)
					}
				}
				delivered := 0
				for i := range outs {
					if outs[i].deliver {
						delivered++
					}
				}
				if delivered != per {
					b.Fatalf("job %d: %d effects to deliver, want %d", n, delivered, per)
				}
			}
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
		})
	}
}

// cpuTime is the CPU time the process has used, user and system, in
// nanoseconds.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
