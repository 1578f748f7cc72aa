package streamsink

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// BenchmarkDecideRepublish measures what the runner does per effect besides
// the network: read the stamp, judge it, build the downstream message.
func BenchmarkDecideRepublish(b *testing.B) {
	cfg := Config{Prefix: "bench", Logger: slog.New(slog.DiscardHandler)}
	cfg.setDefaults()
	r := &Runner{cfg: cfg, rep: sink.NewReporter(sink.ReporterConfig{Name: "b", Logger: cfg.Logger}), fences: newFenceTable(numShards), groups: newGroups()}
	msgs := make([]*logMsg, 2000)
	for i := range msgs {
		h := nats.Header{}
		leasehold.Stamp{Scope: "bench", Partition: leasehold.Partition(i % 16), Epoch: 5, Acquisition: "a5", Key: fmt.Sprintf("bench.out.x.1.%d", i)}.SetHeader(h)
		h.Set("Nats-Msg-Id", "x")
		msgs[i] = &logMsg{seq: uint64(i + 1), subject: "bench.out.x", header: h, data: make([]byte, 256)}
	}
	ctx := context.Background()
	for p := range leasehold.Partition(16) {
		r.fences.add(leasehold.FenceID{Scope: "bench", Partition: p}, rise{Epoch: 5, Acquisition: "a5"})
	}
	w := &work{}
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		m := msgs[i%len(msgs)]
		w.seq = m.seq - 1
		o, err := r.decide(ctx, w, m, nil)
		if err != nil || !o.deliver {
			b.Fatal(err)
		}
		_ = r.republished(ctx, m, o.d.Stamp)
	}
}

// BenchmarkDecideJob measures the runner's decision for the effects a
// worker publishes: each job's one effect, its final, placed in its group
// and applied at once, jobs in order on 16 partitions.
func BenchmarkDecideJob(b *testing.B) {
	cfg := Config{Prefix: "bench", Logger: slog.New(slog.DiscardHandler)}
	cfg.setDefaults()
	const parts = 16
	var r *Runner
	reset := func() {
		r = &Runner{cfg: cfg, rep: sink.NewReporter(sink.ReporterConfig{Name: "b", Logger: cfg.Logger}), fences: newFenceTable(numShards), groups: newGroups()}
		for p := range leasehold.Partition(parts) {
			r.fences.add(leasehold.FenceID{Scope: "bench", Partition: p}, rise{Epoch: 5, Acquisition: "a5"})
		}
	}
	reset()
	// The messages as the runner's client hands them over, built once.
	msgs := make([]*logMsg, 1<<15)
	data := make([]byte, 256)
	for i := range msgs {
		p := leasehold.Partition(i % parts)
		job := uint64(i/parts + 1)
		h := nats.Header{}
		leasehold.Stamp{Scope: "bench", Partition: p, Epoch: 5, Acquisition: "a5", Key: fmt.Sprintf("bench.%d.%d.0", p, job)}.SetHeader(h)
		leasehold.JobMark{Job: job, Attempt: 1, Effects: 1, After: job - 1}.SetHeader(h)
		msgs[i] = &logMsg{seq: uint64(i + 1), subject: fmt.Sprintf("bench.out.%d", p), header: h, data: data}
	}
	ctx := context.Background()
	w := &work{}
	var outs []outcome
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%len(msgs) == 0 && i > 0 {
			b.StopTimer()
			reset()
			b.StartTimer()
		}
		m := msgs[i%len(msgs)]
		w.seq = m.seq - 1
		outs = outs[:0]
		o, err := r.decide(ctx, w, m, &outs)
		if err != nil || o.deliver || len(outs) != 1 || !outs[0].deliver {
			b.Fatalf("message %d: %v, %d outcomes", m.seq, err, len(outs))
		}
	}
}

// BenchmarkDecideJobThree measures the runner's decision for jobs of
// three effects: two held back in the job's group until the third, the
// final, completes it and all three are applied, jobs in order on 16
// partitions.
func BenchmarkDecideJobThree(b *testing.B) {
	cfg := Config{Prefix: "bench", Logger: slog.New(slog.DiscardHandler)}
	cfg.setDefaults()
	const parts = 16
	var r *Runner
	reset := func() {
		r = &Runner{cfg: cfg, rep: sink.NewReporter(sink.ReporterConfig{Name: "b", Logger: cfg.Logger}), fences: newFenceTable(numShards), groups: newGroups()}
		for p := range leasehold.Partition(parts) {
			r.fences.add(leasehold.FenceID{Scope: "bench", Partition: p}, rise{Epoch: 5, Acquisition: "a5"})
		}
	}
	reset()
	msgs := make([]*logMsg, 3<<14)
	data := make([]byte, 256)
	for i := range msgs {
		n := i / 3
		p := leasehold.Partition(n % parts)
		job := uint64(n/parts + 1)
		h := nats.Header{}
		leasehold.Stamp{Scope: "bench", Partition: p, Epoch: 5, Acquisition: "a5", Key: fmt.Sprintf("bench.%d.%d.%d", p, job, i%3)}.SetHeader(h)
		mark := leasehold.JobMark{Job: job, Attempt: job}
		if i%3 == 2 {
			mark.Effects, mark.After = 3, job-1
		}
		mark.SetHeader(h)
		msgs[i] = &logMsg{seq: uint64(i + 1), subject: fmt.Sprintf("bench.out.%d", p), header: h, data: data}
	}
	ctx := context.Background()
	w := &work{}
	var outs []outcome
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%len(msgs) == 0 && i > 0 {
			b.StopTimer()
			reset()
			b.StartTimer()
		}
		m := msgs[i%len(msgs)]
		w.seq = m.seq - 1
		outs = outs[:0]
		o, err := r.decide(ctx, w, m, &outs)
		want := 0
		if i%3 == 2 {
			want = 3
		}
		if err != nil || o.deliver || len(outs) != want {
			b.Fatalf("message %d: %v, %d outcomes, want %d", m.seq, err, len(outs), want)
		}
	}
}
