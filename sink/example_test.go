package sink_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// A new holder advances the fence when it acquires the partition; the
// former holder's late write is then refused with the typed error, and
// the observer sees every decision.
func ExampleNewMemory() {
	ctx := context.Background()
	m := sink.NewMemory(sink.MemoryConfig{
		Logger: slog.New(slog.DiscardHandler),
		Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
			fmt.Printf("observed: %s on partition %d at epoch %d (key %q)\n", d.Outcome, d.Stamp.Partition, d.Stamp.Epoch, d.Stamp.Key)
		}),
	})
	w1 := leasehold.Lease{Scope: "orders", Partition: 3, Epoch: 41, Acquisition: "a41", Holder: "w1"}
	_ = m.Apply(ctx, sink.Effect{Stamp: w1.Stamp("orders.3.17.0"), Subject: "order-17", Data: []byte("paid")})

	// w2 acquires partition 3 at epoch 42 and fences it before writing.
	w2 := leasehold.Lease{Scope: "orders", Partition: 3, Epoch: 42, Acquisition: "a42", Holder: "w2"}
	_ = m.Advance(ctx, w2)

	// w1 was paused; its next write arrives late.
	late := w1.Stamp("orders.3.18.0")
	err := m.Apply(ctx, sink.Effect{Stamp: late, Subject: "order-18", Data: []byte("paid")})
	var stale *leasehold.StaleEpochError
	if errors.As(err, &stale) {
		fmt.Printf("refused: epoch %d < %d\n", stale.Epoch, stale.Max)
	}
	fmt.Println("dropped on partition 3:", m.Dropped(w1.Fence()))
	// Output:
	// observed: accepted on partition 3 at epoch 41 (key "orders.3.17.0")
	// observed: advanced on partition 3 at epoch 42 (key "")
	// observed: stale on partition 3 at epoch 41 (key "orders.3.18.0")
	// refused: epoch 41 < 42
	// dropped on partition 3: 1
}
