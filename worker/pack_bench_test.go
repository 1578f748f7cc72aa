package worker_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// BenchmarkJobEmits runs jobs of one and of three effects in memory
// (worker.InMemory: the worker's own code from the handler to the publish,
// with no server), with and without PackEffects, for the allocations and
// CPU a job's effects cost the worker:
//
//	go test ./worker -run '^$' -bench JobEmits -benchmem
func BenchmarkJobEmits(b *testing.B) {
	for _, c := range []struct {
		k    int
		pack bool
	}{{1, false}, {1, true}, {3, false}, {3, true}} {
		name := fmt.Sprint(c.k)
		if c.pack {
			name += "packed"
		}
		b.Run(name, func(b *testing.B) {
			data := make([]byte, 256)
			m, err := worker.NewInMemory(worker.Config{
				Prefix: "bench", Partitions: 1, PackEffects: c.pack, Logger: slog.New(slog.DiscardHandler),
				Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
					for range c.k {
						if err := j.Emit(ctx, data); err != nil {
							return err
						}
					}
					return nil
				}),
			}, leasehold.Lease{Scope: "bench", Epoch: 1, Acquisition: "a1", Holder: "w"})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			p := m.Producer()
			key := []byte("k")
			b.ReportAllocs()
			for b.Loop() {
				if _, err := p.Enqueue(ctx, key, data); err != nil {
					b.Fatal(err)
				}
				res, ok := m.Next(ctx)
				if !ok || !res.Done {
					b.Fatalf("the job did not complete: %+v", res)
				}
			}
		})
	}
}
