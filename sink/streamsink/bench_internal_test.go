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
